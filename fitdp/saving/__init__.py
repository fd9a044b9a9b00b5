"""Everything written to disk: checkpoint entries and files, the seal, atomic and
background writers, weights files and export."""
