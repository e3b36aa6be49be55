#pragma once

// Sequence state files (llama-server slot files) with a checksum (pyturbo; not specific to turboq).
//
// llama.cpp's state format carries no checksum: a flipped byte in a count can restore as
// garbage, and a flipped byte in K/V data silently changes the cache. A sequence state file
// written here ends with a record {"TQCK", CRC-32 of every byte before it}; a file whose record
// does not match is refused. A file without the record (another build) is read as before.

// appends the record to a file just written; false (with an error logged) on an I/O error
bool llama_state_seq_file_seal(const char * path);

// 1: the record is there and matches; 0: no record; -1: the record does not match (logged)
int llama_state_seq_file_check(const char * path);

