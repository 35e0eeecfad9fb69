"""kafila-ctl: the command-line client of kafilad."""
