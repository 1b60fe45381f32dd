"""The layout of a run: the parallel flags (`flags`), the degree of every parallel dimension (`dims`),
the rules of which layouts may run (`rules`), what a launcher says and a `--deepspeed` file holds, and
how the run's settings adopt them (`launcher`, `deepspeed`). The layer below the config: it never
imports `toolkit.config`, nor torch; the config gives it plain values and dicts."""
