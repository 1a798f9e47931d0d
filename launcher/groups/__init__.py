"""Config groups: one module (or package) per group, holding its schema and pure build/apply functions."""
