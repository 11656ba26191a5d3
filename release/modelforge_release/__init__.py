"""Release tooling for ModelForge: the four images, the release bundle, and its verifiers.

``modelforge-release images`` builds the images from the Debian packages pinned in
``debian.py``'s lock (fetched and read in ``debs.py``) and locked wheels
(``python_packages.py``): each layer a chiselled tree (``rootfs.py``, ``layers.py``),
checked (``image_checks.py``), written and loaded into dockerd (``build.py``), as
``images.py`` describes them. ``bundle`` saves them with the manifest and SHA256SUMS
(``bundle.py``); ``verify-sums`` and ``verify-bundle`` (``verify.py``, ``archive.py``,
``tarstream.py``), ``verify-image`` and ``verify-container`` (``dockerd.py``) check a
release. ``dockerfiles.py`` writes the Dockerfiles of Compose source builds.
"""
