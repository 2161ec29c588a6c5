"""Run mergekit itself on mergekit YAML configs, in mergekit's own environment (see `mergekit_runs`).

Usage: python mergekit_reference.py JOBS.json, where the file lists [config.yml, out_dir, seed] triples.
One process for many merges: mergekit's import dominates a tiny merge.
"""

import json
import sys

import yaml
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions

for config_file, out_dir, seed in json.loads(open(sys.argv[1]).read()):
    with open(config_file) as handle:
        source = handle.read()
    options = MergeOptions(random_seed=seed, copy_tokenizer=False, quiet=True, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(yaml.safe_load(source)), out_dir, options=options,
              config_source=source)
