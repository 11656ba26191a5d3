"""Release tooling for ModelForge: SHA256SUMS in GNU coreutils format, and its checker.

Image builds, the bundle and the manifest verifier come with a later issue.
"""
