"""vllm-clover: Clover / Clover-2 speculative decoding as a vLLM plugin.

Importing this package is deliberately cheap (no torch, no vLLM): vLLM imports the
plugin entry point in every process it starts.
"""

__version__ = "0.1.0"

# The one vLLM release the plugin's patches were written and tested against.
PINNED_VLLM_VERSION = "0.32.0"
