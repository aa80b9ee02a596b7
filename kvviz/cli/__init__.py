"""The command line, `python -m kvviz`: the table of subcommands (main.py), their shared argument types, and each larger subcommand's own arguments and report."""
