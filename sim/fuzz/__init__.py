"""Property-based fuzzing of the scheduler invariants (docs/fuzzing.md).

strategies (scenario dicts) → campaign (one search: find, shrink) → parallel (N workers, one
database) → finding (scenario.toml + finding.json) ; toml_out writes TOML; labels name paths.
"""
