"""The fork: unified diffs against openrlhf==0.11.2 (shipped as package data; applied by openrlhf_geo.fork.install)."""
