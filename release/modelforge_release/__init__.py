"""Release tooling for ModelForge: the four images, the release bundle, and its verifiers.

``modelforge-release images`` builds the images from pinned Debian packages and locked
wheels (``rootfs.py``, ``images.py``); ``bundle`` saves them with the manifest and
SHA256SUMS (``bundle.py``); ``verify-sums``, ``verify-bundle`` (``verify.py``,
``archive.py``), ``verify-image`` and ``verify-container`` (``dockerd.py``) check a release.
"""
