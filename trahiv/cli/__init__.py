"""The `trahiv` command: one module per subcommand, each registering its own parser."""
