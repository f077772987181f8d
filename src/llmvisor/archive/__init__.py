"""The raw-step archive: every engine step as trace-format Parquet, rotated per run and window (issue 22)."""

from llmvisor.archive.reader import ArchiveReadError, archive_files, read_archive
from llmvisor.archive.writer import (
    ENV_ARCHIVE_URL,
    ENV_ARCHIVE_WINDOW_S,
    ArchiveStats,
    ArchiveWriter,
    file_name,
    parse_file_name,
    window_start_ms,
)

__all__ = [
    "ENV_ARCHIVE_URL", "ENV_ARCHIVE_WINDOW_S", "ArchiveReadError", "ArchiveStats", "ArchiveWriter", "archive_files",
    "file_name", "parse_file_name", "read_archive", "window_start_ms",
]
