"""Worker metrics (Prometheus), the executor clock behind the bubble ratio, and the spans files."""
