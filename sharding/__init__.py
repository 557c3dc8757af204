"""Where arrays live, and a planner for where a model would fit.

Placement, the bottom layer (imports nothing of jaxserve): strategies.py (the names),
mesh.py (device meshes), rules.py (logical axis -> mesh axes per strategy),
multihost.py (joining a multi-process job). The planner (planner.py, plan_report.py) is a
tool on top of the engine: it compiles the engine's step for a topology.
"""
