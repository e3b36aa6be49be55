#include "llama-state-seal.h"

#include "llama-impl.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr char SEAL_MAGIC[4] = {'T', 'Q', 'C', 'K'};

uint32_t crc32_update(uint32_t crc, const uint8_t * p, size_t n) {
    static uint32_t table[256];
    static const bool init = [] {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) {
                c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            }
            table[i] = c;
        }
        return true;
    }();
    (void) init;
    crc = ~crc;
    for (size_t i = 0; i < n; ++i) {
        crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    }
    return ~crc;
}

// CRC-32 of the first n bytes of f (from its start); false on a short read
bool crc32_of_prefix(FILE * f, long n, uint32_t & crc) {
    std::vector<uint8_t> buf(1 << 20);
    crc = 0;
    if (std::fseek(f, 0, SEEK_SET) != 0) {
        return false;
    }
    long left = n;
    while (left > 0) {
        const size_t want = (size_t) std::min<long>(left, (long) buf.size());
        if (std::fread(buf.data(), 1, want, f) != want) {
            return false;
        }
        crc = crc32_update(crc, buf.data(), want);
        left -= (long) want;
    }
    return true;
}

} // namespace

bool llama_state_seq_file_seal(const char * path) {
    FILE * f = std::fopen(path, "r+b");
    if (!f) {
        LLAMA_LOG_ERROR("%s: cannot reopen %s to seal it\n", __func__, path);
        return false;
    }
    bool ok = std::fseek(f, 0, SEEK_END) == 0;
    const long size = ok ? std::ftell(f) : -1;
    uint32_t crc = 0;
    ok = ok && size >= 0 && crc32_of_prefix(f, size, crc) && std::fseek(f, 0, SEEK_END) == 0 &&
         std::fwrite(SEAL_MAGIC, 1, 4, f) == 4 && std::fwrite(&crc, 1, 4, f) == 4;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
        LLAMA_LOG_ERROR("%s: failed to seal %s\n", __func__, path);
    }
    return ok;
}

int llama_state_seq_file_check(const char * path) {
    FILE * f = std::fopen(path, "rb");
    if (!f) {
        return 0; // the reader reports a missing file
    }
    int res = 0;
    char magic[4];
    uint32_t stored = 0;
    long size = -1;
    if (std::fseek(f, 0, SEEK_END) == 0 && (size = std::ftell(f)) >= 8 && std::fseek(f, size - 8, SEEK_SET) == 0 &&
        std::fread(magic, 1, 4, f) == 4 && std::fread(&stored, 1, 4, f) == 4 && std::memcmp(magic, SEAL_MAGIC, 4) == 0) {
        uint32_t crc = 0;
        if (crc32_of_prefix(f, size - 8, crc) && crc == stored) {
            res = 1;
        } else {
            LLAMA_LOG_ERROR("%s: %s is corrupt: its CRC-32 is %08x, the file says %08x\n", __func__, path, crc, stored);
            res = -1;
        }
    }
    std::fclose(f);
    return res;
}

