"""What a run leaves behind: final_summary.json, the comparison of two runs, the export
and the Perfetto trace, analysis of deep traces."""
