"""Where a job's model and data live: volumes the pods mount, and URIs fetched once into the cache."""
