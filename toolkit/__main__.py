"""`python -m toolkit <command>`: the commands are `toolkit.cli`'s."""

from toolkit.cli.main import main

if __name__ == "__main__":
    main()
