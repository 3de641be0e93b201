"""What every study shares: suites of runs, how figures are stated and drawn, the wall-clock
model, held-out corpora and the kind and schema of results.json."""
