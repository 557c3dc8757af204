"""The names a user picks to place a model: mesh axes and sharding strategies.

No JAX here, so the config and the CLI's `--help` can name them without loading it;
sharding/rules.py says what each strategy splits.
"""

MESH_AXES = ("data", "model")
DATA, MODEL = MESH_AXES
STRATEGIES = ("tp", "tp+sp", "dp", "dp+tp", "dp+tp+sp", "ep", "tp+ep", "dp+ep", "dp+tp+ep")
