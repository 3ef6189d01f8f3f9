"""clef-export: the joint schema head of a Clef release as an Apple Core AI asset (and a Core ML
package), proven against the author's own head.

Pipeline: pins (``pin``: a Hub commit or a local release) + recipe -> source (fetch, verify
sha256) -> author (the verified ``joint_schema_model.py``, strict load) -> graph
(``ClefHeadGraph``, tensor inputs only) -> worker (the recipe's backend, ``aimodel`` or
``mlpackage``: trace, convert, save; same bytes on any machine) -> bundle + manifest + build
record -> gate (the saved asset run against the author's head). ``host`` is the numpy-only spec
of the arrays a host builds to call the head.
"""

__version__ = "0.1.0"
