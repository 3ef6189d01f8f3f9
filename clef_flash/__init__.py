"""clef-export: the joint schema head of a Clef release as an Apple Core AI asset (and a Core ML
package), proven against the author's own head.

How it works: docs/modules.md."""

__version__ = "0.1.0"
