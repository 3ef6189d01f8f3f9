"""The vision tower: a release's ``model.visual.*`` exported as one Core AI asset with one static
function per patch-count bucket, so an image of any aspect ratio up to the cap runs at its native grid.

How it works: docs/modules.md."""
