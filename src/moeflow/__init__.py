"""moeflow: a reproducible pipeline for fine-tuning mixture-of-experts language models.

One module per concern; the Snakemake stage scripts in ``workflow/scripts`` are thin
wrappers over these modules, and the tests import them directly.
"""

__version__ = "0.1.0"

from moeflow.runtime.compat import skip_transformers_sklearn_import

skip_transformers_sklearn_import()
