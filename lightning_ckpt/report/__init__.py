"""The output stage: what a plan looks like to people (its table, metrics, the JSON and the trade-off plot)."""
