"""`python -m mergekit_lite.cli`: the `mergekit-lite` command, as the console script runs it."""

from mergekit_lite.cli.main import main

main()
