"""clef-export: the clef-flash joint schema head as an Apple Core AI asset.

Pipeline: recipe + pins -> source (fetch, verify sha256) -> author (import the verified
``joint_schema_model.py``, strict load) -> graph (``ClefHeadGraph``, tensor inputs only) ->
export (``torch.export`` per bucket, one coreai-torch converter, one ``.aimodel``) -> bundle +
manifest (``metadata.json``). ``gate`` runs a finished bundle with the Core AI runtime against the
author's head. ``host`` is the numpy-only spec of the arrays a host builds to call the head.
"""

__version__ = "0.1.0"
