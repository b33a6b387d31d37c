"""The command line: the typer app, its commands and the Rich views."""
