"""The layout of a run: the degree of every parallel dimension (`dims`) and the rules of which
layouts may run (`rules`). The bottom layer beside the config: pure, no torch."""
