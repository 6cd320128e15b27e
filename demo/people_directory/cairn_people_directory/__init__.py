"""The demo people directory: a company system that gives cairn's agents tools."""
