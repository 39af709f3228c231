"""Speculation: chain drafting and verification, dynamic draft trees, the TABED ensemble of
draft views (policies, divergence history), the views themselves, and sampling."""
