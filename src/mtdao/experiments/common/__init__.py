"""What several studies share: suites of runs, how figures are stated and drawn, held-out corpora
and how results.json and the report rendered from it are written."""
