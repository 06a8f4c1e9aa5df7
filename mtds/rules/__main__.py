"""``python -m mtds.rules``: the rulebook as the table docs/bad_input.md holds."""
from mtds.rules.book import markdown_table

print(markdown_table())
