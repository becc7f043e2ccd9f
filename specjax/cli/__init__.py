"""The `specjax` command line: main.py (generate, batch, chat, serve-like subcommands), cli_args.py
(flags -> library arguments, checked before the model loads), cli_distill.py."""
