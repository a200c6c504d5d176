/* mst._accel: the native verification path (CAR parsing with block hashing, and MST operation
 * inversion with node decoding, re-encoding and hashing, in one compiled pass).
 *
 * Contract: every function here either returns exactly what the Python reference (mst/_car.py,
 * mst/_invert.py, mst/_node.py) returns for the same input, or returns None ("not handled
 * here"), and then the caller runs the reference, which produces the result or the typed error
 * with its reason. The native code therefore only ever *accepts*: it handles the canonical,
 * well-formed inputs and declines anything else (any malformed, non-canonical, oversized or merely
 * unusual input), so the verdicts and reasons of the two paths are identical by construction; the
 * differential tests in tests/mst/test_accel.py check it on the interop vectors and on randomized
 * repositories. It never raises for bad input (only MemoryError and the like).
 *
 * SHA-256 is OpenSSL's (libcrypto's low-level one-shot interface: no per-call algorithm fetch).
 */
#define PY_SSIZE_T_CLEAN
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <structmember.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef ACCEL_SOURCE_SHA256
#define ACCEL_SOURCE_SHA256 ""
#endif

static const uint8_t DAG_PREFIX[4] = {0x01, 0x71, 0x12, 0x20};
static const uint8_t RAW_PREFIX[4] = {0x01, 0x55, 0x12, 0x20};
static const uint8_t LINK_HEAD[5] = {0xd8, 0x2a, 0x58, 0x25, 0x00}; /* tag 42, bytes(37), 0x00 */
#define CID_LEN 36
#define MAX_KEY_BYTES 1024
#define MAX_HEADER_BYTES (64 * 1024)

/* cbrrr.CID: a Python class with __slots__ = ("cid_bytes",); set up by init(CID) */
static PyTypeObject *CID_type = NULL;
static Py_ssize_t cid_bytes_offset = -1;

static void sha256(const uint8_t *data, size_t n, uint8_t out[32]) {
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, data, n);
    SHA256_Final(out, &ctx);
}

static int is_blessed(const uint8_t *cid) {
    return memcmp(cid, DAG_PREFIX, 4) == 0 || memcmp(cid, RAW_PREFIX, 4) == 0;
}

/* A new CID object for 36 bytes (its __init__ only stores the bytes; done directly here). */
static PyObject *make_cid(const uint8_t *cid) {
    PyObject *b = PyBytes_FromStringAndSize((const char *)cid, CID_LEN);
    if (b == NULL) return NULL;
    PyObject *obj = CID_type->tp_alloc(CID_type, 0);
    if (obj == NULL) {
        Py_DECREF(b);
        return NULL;
    }
    *(PyObject **)((char *)obj + cid_bytes_offset) = b;
    return obj;
}

/* 1 when a CID's hash is its bytes' hash (cbrrr.CID.__hash__), checked by init: then a dict keyed by
 * CIDs can be filled from C without calling the Python-level __hash__ for every key. */
static int cid_hash_is_bytes_hash = 0;

/* dict[key] = value for a CID ``key`` made by make_cid */
static int set_cid_item(PyObject *dict, PyObject *key, PyObject *value) {
#if PY_VERSION_HEX < 0x030D0000
    if (cid_hash_is_bytes_hash) {
        Py_hash_t h = PyObject_Hash(*(PyObject **)((char *)key + cid_bytes_offset));
        if (h == -1) return -1;
        return _PyDict_SetItem_KnownHash(dict, key, value, h);
    }
#endif
    return PyDict_SetItem(dict, key, value);
}

/* The 36 cid bytes of an exact CID object with a 36-byte bytes value, else NULL (no error set). */
static const uint8_t *cid_bytes_of(PyObject *obj) {
    if (obj == NULL || Py_TYPE(obj) != CID_type) return NULL;
    PyObject *b = *(PyObject **)((char *)obj + cid_bytes_offset);
    if (b == NULL || !PyBytes_CheckExact(b) || PyBytes_GET_SIZE(b) != CID_LEN) return NULL;
    return (const uint8_t *)PyBytes_AS_STRING(b);
}

/* ---------------------------------------------------------------------------------------- */
/* arena: every node of one inversion lives here, freed at once                              */

typedef struct Chunk {
    struct Chunk *next;
    size_t used, cap;
    uint8_t data[];
} Chunk;

typedef struct {
    Chunk *head;
    uint8_t first[16384];
    size_t first_used;
} Arena;

static void *arena_alloc(Arena *a, size_t n) {
    n = (n + 7) & ~(size_t)7;
    if (a->head == NULL && a->first_used + n <= sizeof(a->first)) {
        void *p = a->first + a->first_used;
        a->first_used += n;
        return p;
    }
    if (a->head == NULL || a->head->used + n > a->head->cap) {
        size_t cap = n > 65536 ? n : 65536;
        Chunk *c = malloc(sizeof(Chunk) + cap);
        if (c == NULL) return NULL;
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void arena_free(Arena *a) {
    Chunk *c = a->head;
    while (c != NULL) {
        Chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
}

/* ---------------------------------------------------------------------------------------- */
/* MST keys: validity and height                                                             */

static int key_char_ok[256];

static int valid_key(const uint8_t *k, Py_ssize_t n) {
    if (n > MAX_KEY_BYTES) return 0;
    Py_ssize_t slash = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t c = k[i];
        if (c == '/') {
            if (slash >= 0) return 0;
            slash = i;
        } else if (!key_char_ok[c]) {
            return 0;
        }
    }
    return slash > 0 && slash < n - 1;
}

static int digest_height(const uint8_t d[32]) {
    int zeros = 0;
    for (int i = 0; i < 32; i++) {
        if (d[i] == 0) {
            zeros += 8;
            continue;
        }
        zeros += __builtin_clz((unsigned)d[i]) - 24;
        break;
    }
    return zeros >> 1;
}

/* Height of a key already known to be valid. (No cache: a table of recent keys measured slower
 * than hashing once the signature check's tables have evicted it from the CPU caches.) */
static int key_height(const uint8_t *k, Py_ssize_t n) {
    uint8_t d[32];
    sha256(k, (size_t)n, d);
    return digest_height(d);
}

/* ---------------------------------------------------------------------------------------- */
/* CBOR heads (canonical: minimal length)                                                    */

/* Reads a head of major type ``major`` at *pos; 1 on success, 0 if absent/other/non-minimal. */
static int read_head(const uint8_t *d, size_t end, size_t *pos, int major, uint64_t *val) {
    size_t p = *pos;
    if (p >= end) return 0;
    uint8_t b = d[p++];
    if ((b >> 5) != major) return 0;
    uint8_t ai = b & 31;
    uint64_t v;
    if (ai < 24) {
        v = ai;
    } else if (ai == 24) {
        if (p + 1 > end) return 0;
        v = d[p];
        p += 1;
        if (v < 24) return 0;
    } else if (ai == 25) {
        if (p + 2 > end) return 0;
        v = ((uint64_t)d[p] << 8) | d[p + 1];
        p += 2;
        if (v < 256) return 0;
    } else if (ai == 26) {
        if (p + 4 > end) return 0;
        v = ((uint64_t)d[p] << 24) | ((uint64_t)d[p + 1] << 16) | ((uint64_t)d[p + 2] << 8) | d[p + 3];
        p += 4;
        if (v < 65536) return 0;
    } else {
        return 0; /* 8-byte arguments and indefinite lengths never occur in what we accept */
    }
    *pos = p;
    *val = v;
    return 1;
}

static size_t head_size(uint64_t v) {
    return v < 24 ? 1 : v < 256 ? 2 : v < 65536 ? 3 : 5;
}

static uint8_t *write_head(uint8_t *o, int major, uint64_t v) {
    uint8_t m = (uint8_t)(major << 5);
    if (v < 24) {
        *o++ = m | (uint8_t)v;
    } else if (v < 256) {
        *o++ = m | 24;
        *o++ = (uint8_t)v;
    } else if (v < 65536) {
        *o++ = m | 25;
        *o++ = (uint8_t)(v >> 8);
        *o++ = (uint8_t)v;
    } else {
        *o++ = m | 26;
        *o++ = (uint8_t)(v >> 24);
        *o++ = (uint8_t)(v >> 16);
        *o++ = (uint8_t)(v >> 8);
        *o++ = (uint8_t)v;
    }
    return o;
}

/* expects the 2 bytes ``0x61 <c>`` (a one-letter text key) at *pos */
static int read_key1(const uint8_t *d, size_t end, size_t *pos, char c) {
    if (*pos + 2 > end || d[*pos] != 0x61 || d[*pos + 1] != (uint8_t)c) return 0;
    *pos += 2;
    return 1;
}

/* A link (``tag 42, bytes(37), 0x00 + 36-byte CID``) or, if ``nullable``, null at *pos.
 * *out = the 36 CID bytes or NULL for null. ``dag_only``: the CID must be dag-cbor, else blessed. */
static int read_link(const uint8_t *d, size_t end, size_t *pos, int nullable, int dag_only,
                     const uint8_t **out) {
    size_t p = *pos;
    if (p >= end) return 0;
    if (d[p] == 0xf6) {
        if (!nullable) return 0;
        *out = NULL;
        *pos = p + 1;
        return 1;
    }
    if (p + 5 + CID_LEN > end || memcmp(d + p, LINK_HEAD, 5) != 0) return 0;
    const uint8_t *cid = d + p + 5;
    if (dag_only ? memcmp(cid, DAG_PREFIX, 4) != 0 : !is_blessed(cid)) return 0;
    *out = cid;
    *pos = p + 5 + CID_LEN;
    return 1;
}

/* ---------------------------------------------------------------------------------------- */
/* nodes (the mirror of mst/_node.py's Node and its persistent algorithms)                   */

typedef struct Node Node;
typedef struct {
    const uint8_t *cid; /* the link, when not loaded (NULL with node NULL: an empty slot) */
    Node *node;         /* the loaded or new subtree */
} Sub;
typedef struct {
    const uint8_t *p;
    Py_ssize_t n;
} Key;
struct Node {
    int layer;
    int n;
    Key *keys;
    const uint8_t **vals; /* 36-byte CIDs */
    Sub *subs;            /* n + 1 */
    int has_cid;
    uint8_t cid[CID_LEN];
};

typedef struct {
    const uint8_t *cid; /* NULL: empty slot */
    PyObject *block;    /* borrowed from the dict (which the caller's frame keeps alive) */
} BSlot;

typedef struct {
    Arena arena;
    PyObject *blocks; /* dict CID -> bytes */
    BSlot *table;     /* the dict's entries by CID bytes (open addressing), or NULL */
    size_t mask;
    PyObject *keep;   /* list: objects whose buffers nodes point into */
    int bail;         /* 1: not handled here (the reference decides); 2: a Python error is set */
    int track;        /* record the CIDs of the blocks load_node reads (invert's ``seen``) */
    uint8_t (*seen)[CID_LEN];
    size_t nseen, capseen;
} Ctx;

/* A context over ``blocks`` with an empty arena and table; ``keep`` as given (may be NULL). */
static Ctx *ctx_new(PyObject *blocks, PyObject *keep) {
    Ctx *ctx = PyMem_Malloc(sizeof(Ctx));
    if (ctx == NULL) {
        Py_XDECREF(keep);
        return NULL;
    }
    ctx->arena.head = NULL;
    ctx->arena.first_used = 0;
    ctx->blocks = blocks;
    ctx->table = NULL;
    ctx->mask = 0;
    ctx->bail = 0;
    ctx->keep = keep;
    ctx->track = 0;
    ctx->seen = NULL;
    ctx->nseen = ctx->capseen = 0;
    return ctx;
}

#define BAIL(ctx) ((ctx)->bail = 1, NULL)

static Node *node_new(Ctx *ctx, int layer, int n) {
    Node *nd = arena_alloc(&ctx->arena, sizeof(Node) + (size_t)n * (sizeof(Key) + sizeof(uint8_t *)) +
                                             (size_t)(n + 1) * sizeof(Sub));
    if (nd == NULL) {
        PyErr_NoMemory();
        ctx->bail = 2;
        return NULL;
    }
    nd->layer = layer;
    nd->n = n;
    nd->keys = (Key *)(nd + 1);
    nd->vals = (const uint8_t **)(nd->keys + n);
    nd->subs = (Sub *)(nd->vals + n);
    nd->has_cid = 0;
    return nd;
}

static int key_cmp(Key a, Key b) {
    Py_ssize_t m = a.n < b.n ? a.n : b.n;
    int c = memcmp(a.p, b.p, (size_t)m);
    if (c) return c;
    return (a.n > b.n) - (a.n < b.n);
}

static int bisect_left(const Node *nd, Key k) {
    int lo = 0, hi = nd->n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (key_cmp(nd->keys[mid], k) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* decode_node: the node block ``d[0:end]`` (CID ``cid``), expected at ``layer`` (-1: a root). */
static Node *decode_node(Ctx *ctx, const uint8_t *d, size_t end, const uint8_t *cid, int layer) {
    size_t pos = 0;
    uint64_t n, v;
    if (end < 1 || d[0] != 0xa2) return BAIL(ctx);
    pos = 1;
    /* an entry takes at least 50 bytes: a count beyond that is declined before allocating */
    if (!read_key1(d, end, &pos, 'e') || !read_head(d, end, &pos, 4, &n) || n > end / 50) return BAIL(ctx);
    Node *nd = node_new(ctx, 0, (int)n);
    if (nd == NULL) return NULL;
    Key prev = {NULL, 0};
    int h0 = -1;
    for (int i = 0; i < (int)n; i++) {
        uint64_t klen, p;
        const uint8_t *t, *val;
        if (pos >= end || d[pos] != 0xa4) return BAIL(ctx);
        pos++;
        if (!read_key1(d, end, &pos, 'k') || !read_head(d, end, &pos, 2, &klen) || klen > end - pos)
            return BAIL(ctx);
        const uint8_t *suffix = d + pos;
        pos += klen;
        if (!read_key1(d, end, &pos, 'p') || !read_head(d, end, &pos, 0, &p)) return BAIL(ctx);
        if (!read_key1(d, end, &pos, 't') || !read_link(d, end, &pos, 1, 1, &t)) return BAIL(ctx);
        if (!read_key1(d, end, &pos, 'v') || !read_link(d, end, &pos, 0, 0, &val)) return BAIL(ctx);
        /* prefix in range, suffix non-empty and sorting after the previous key's rest (so the
         * shared prefix is exactly p, prefix compression is maximal and keys strictly increase) */
        if (p > (uint64_t)prev.n || klen == 0) return BAIL(ctx);
        if (p < (uint64_t)prev.n && suffix[0] <= prev.p[p]) return BAIL(ctx);
        Py_ssize_t kn = (Py_ssize_t)(p + klen);
        if (kn > MAX_KEY_BYTES) return BAIL(ctx);
        uint8_t *key = arena_alloc(&ctx->arena, (size_t)kn);
        if (key == NULL) {
            PyErr_NoMemory();
            ctx->bail = 2;
            return NULL;
        }
        if (p) memcpy(key, prev.p, (size_t)p);
        memcpy(key + p, suffix, (size_t)klen);
        if (!valid_key(key, kn)) return BAIL(ctx);
        int h = key_height(key, kn); /* every key of a node has the node's height */
        if (h0 >= 0 && h != h0) return BAIL(ctx);
        h0 = h;
        nd->keys[i].p = key;
        nd->keys[i].n = kn;
        nd->vals[i] = val;
        nd->subs[i + 1].cid = t;
        nd->subs[i + 1].node = NULL;
        prev = nd->keys[i];
    }
    const uint8_t *left;
    if (!read_key1(d, end, &pos, 'l') || !read_link(d, end, &pos, 1, 1, &left) || pos != end)
        return BAIL(ctx);
    nd->subs[0].cid = left;
    nd->subs[0].node = NULL;
    if (n) {
        if (layer >= 0 && h0 != layer) return BAIL(ctx);
        layer = h0;
    } else if (layer < 0) {
        if (left != NULL) return BAIL(ctx);
        layer = 0;
    } else if (left == NULL) {
        return BAIL(ctx);
    }
    if (layer == 0) {
        for (int i = 0; i <= (int)n; i++)
            if (nd->subs[i].cid != NULL) return BAIL(ctx);
    }
    (void)v;
    nd->layer = layer;
    nd->has_cid = 1;
    memcpy(nd->cid, cid, CID_LEN);
    return nd;
}

/* Indexes the blocks dict by CID bytes; 0, or 1 when a key is not an exact CID (then the
 * reference decides: only it knows how such keys compare), -1 on error. */
static int index_blocks(Ctx *ctx) {
    Py_ssize_t n = PyDict_GET_SIZE(ctx->blocks), pos = 0;
    size_t size = 16;
    while (size < (size_t)n * 2) size <<= 1;
    ctx->table = arena_alloc(&ctx->arena, size * sizeof(BSlot));
    if (ctx->table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(ctx->table, 0, size * sizeof(BSlot));
    ctx->mask = size - 1;
    PyObject *key, *value;
    while (PyDict_Next(ctx->blocks, &pos, &key, &value)) {
        if (Py_TYPE(key) != CID_type) return 1;
        PyObject *b = *(PyObject **)((char *)key + cid_bytes_offset);
        if (b == NULL || !PyBytes_CheckExact(b)) return 1;
        if (PyBytes_GET_SIZE(b) != CID_LEN) continue; /* never equal to a 36-byte link */
        const uint8_t *cid = (const uint8_t *)PyBytes_AS_STRING(b);
        uint64_t h;
        memcpy(&h, cid + 4, 8);
        size_t i = (size_t)h & ctx->mask;
        while (ctx->table[i].cid != NULL && memcmp(ctx->table[i].cid, cid, CID_LEN) != 0)
            i = (i + 1) & ctx->mask;
        ctx->table[i].cid = cid;
        ctx->table[i].block = value;
    }
    return 0;
}

static Node *load_node(Ctx *ctx, const uint8_t *cid, int layer) {
    uint64_t h;
    memcpy(&h, cid + 4, 8);
    size_t i = (size_t)h & ctx->mask;
    PyObject *block = NULL;
    while (ctx->table[i].cid != NULL) {
        if (memcmp(ctx->table[i].cid, cid, CID_LEN) == 0) {
            block = ctx->table[i].block;
            break;
        }
        i = (i + 1) & ctx->mask;
    }
    if (block == NULL || !PyBytes_CheckExact(block)) return BAIL(ctx); /* missing, or not bytes */
    if (ctx->track) { /* a copy: the dict's keys may be gone by the time the set is filled */
        if (ctx->nseen == ctx->capseen) {
            size_t cap = ctx->capseen ? ctx->capseen * 2 : 16;
            void *grown = PyMem_Realloc(ctx->seen, cap * CID_LEN);
            if (grown == NULL) {
                PyErr_NoMemory();
                ctx->bail = 2;
                return NULL;
            }
            ctx->seen = grown;
            ctx->capseen = cap;
        }
        memcpy(ctx->seen[ctx->nseen++], cid, CID_LEN);
    }
    return decode_node(ctx, (const uint8_t *)PyBytes_AS_STRING(block), (size_t)PyBytes_GET_SIZE(block),
                       cid, layer);
}

/* subtree slot i of nd, loaded and memoised (NULL: empty slot, or ctx->bail set) */
static Node *child(Ctx *ctx, Node *nd, int i) {
    Sub *s = &nd->subs[i];
    if (s->node != NULL || s->cid == NULL) return s->node;
    Node *c = load_node(ctx, s->cid, nd->layer - 1);
    if (c != NULL) s->node = c;
    return c;
}

/* the value of ``key`` (height h) under nd: 1 found (*out), 0 absent, -1 bail */
static int node_get(Ctx *ctx, Node *nd, Key key, int h, const uint8_t **out) {
    while (nd != NULL && nd->layer >= h) {
        int i = bisect_left(nd, key);
        if (i < nd->n && key_cmp(nd->keys[i], key) == 0) {
            *out = nd->vals[i];
            return 1;
        }
        if (nd->layer == h) return 0;
        nd = child(ctx, nd, i);
        if (ctx->bail) return -1;
    }
    return 0;
}

static Node *prune(Node *nd) {
    return (nd->n == 0 && nd->subs[0].cid == NULL && nd->subs[0].node == NULL) ? NULL : nd;
}

static void set_sub(Sub *s, Node *nd) {
    s->cid = NULL;
    s->node = nd;
}

/* split nd around key into (lo, hi) at nd's layer; returns 0, or -1 on bail */
static int split(Ctx *ctx, Node *nd, Key key, Node **lo, Node **hi) {
    if (nd == NULL) {
        *lo = *hi = NULL;
        return 0;
    }
    int i = bisect_left(nd, key);
    Node *c = child(ctx, nd, i);
    if (ctx->bail) return -1;
    Node *clo, *chi;
    if (split(ctx, c, key, &clo, &chi) < 0) return -1;
    Node *left = node_new(ctx, nd->layer, i);
    Node *right = node_new(ctx, nd->layer, nd->n - i);
    if (left == NULL || right == NULL) return -1;
    memcpy(left->keys, nd->keys, (size_t)i * sizeof(Key));
    memcpy(left->vals, nd->vals, (size_t)i * sizeof(uint8_t *));
    memcpy(left->subs, nd->subs, (size_t)i * sizeof(Sub));
    set_sub(&left->subs[i], clo);
    memcpy(right->keys, nd->keys + i, (size_t)(nd->n - i) * sizeof(Key));
    memcpy(right->vals, nd->vals + i, (size_t)(nd->n - i) * sizeof(uint8_t *));
    set_sub(&right->subs[0], chi);
    memcpy(right->subs + 1, nd->subs + i + 1, (size_t)(nd->n - i) * sizeof(Sub));
    *lo = prune(left);
    *hi = prune(right);
    return 0;
}

/* join adjacent subtrees a < b of one layer; *out; 0 or -1 on bail */
static int merge(Ctx *ctx, Node *a, Node *b, Node **out) {
    if (a == NULL) {
        *out = b;
        return 0;
    }
    if (b == NULL) {
        *out = a;
        return 0;
    }
    Node *ca = child(ctx, a, a->n);
    if (ctx->bail) return -1;
    Node *cb = child(ctx, b, 0);
    if (ctx->bail) return -1;
    Node *mid;
    if (merge(ctx, ca, cb, &mid) < 0) return -1;
    Node *m = node_new(ctx, a->layer, a->n + b->n);
    if (m == NULL) return -1;
    memcpy(m->keys, a->keys, (size_t)a->n * sizeof(Key));
    memcpy(m->keys + a->n, b->keys, (size_t)b->n * sizeof(Key));
    memcpy(m->vals, a->vals, (size_t)a->n * sizeof(uint8_t *));
    memcpy(m->vals + a->n, b->vals, (size_t)b->n * sizeof(uint8_t *));
    memcpy(m->subs, a->subs, (size_t)a->n * sizeof(Sub));
    set_sub(&m->subs[a->n], mid);
    memcpy(m->subs + a->n + 1, b->subs + 1, (size_t)b->n * sizeof(Sub));
    *out = m;
    return 0;
}

static Node *copy_node(Ctx *ctx, Node *nd) {
    Node *c = node_new(ctx, nd->layer, nd->n);
    if (c == NULL) return NULL;
    memcpy(c->keys, nd->keys, (size_t)nd->n * sizeof(Key));
    memcpy(c->vals, nd->vals, (size_t)nd->n * sizeof(uint8_t *));
    memcpy(c->subs, nd->subs, (size_t)(nd->n + 1) * sizeof(Sub));
    return c;
}

static Node *raise_to(Ctx *ctx, Node *nd, int layer) {
    while (nd != NULL && nd->layer < layer) {
        Node *up = node_new(ctx, nd->layer + 1, 0);
        if (up == NULL) return NULL;
        set_sub(&up->subs[0], nd);
        nd = up;
    }
    return nd;
}

static Node *node_put(Ctx *ctx, Node *nd, Key key, const uint8_t *val, int h) {
    int layer = nd->layer;
    int i = bisect_left(nd, key);
    if (i < nd->n && key_cmp(nd->keys[i], key) == 0) {
        if (memcmp(nd->vals[i], val, CID_LEN) == 0) return nd;
        Node *c = copy_node(ctx, nd);
        if (c == NULL) return NULL;
        c->vals[i] = val;
        return c;
    }
    if (h == layer) {
        Node *c = child(ctx, nd, i);
        if (ctx->bail) return NULL;
        Node *lo, *hi;
        if (split(ctx, c, key, &lo, &hi) < 0) return NULL;
        Node *m = node_new(ctx, layer, nd->n + 1);
        if (m == NULL) return NULL;
        memcpy(m->keys, nd->keys, (size_t)i * sizeof(Key));
        m->keys[i] = key;
        memcpy(m->keys + i + 1, nd->keys + i, (size_t)(nd->n - i) * sizeof(Key));
        memcpy(m->vals, nd->vals, (size_t)i * sizeof(uint8_t *));
        m->vals[i] = val;
        memcpy(m->vals + i + 1, nd->vals + i, (size_t)(nd->n - i) * sizeof(uint8_t *));
        memcpy(m->subs, nd->subs, (size_t)i * sizeof(Sub));
        set_sub(&m->subs[i], lo);
        set_sub(&m->subs[i + 1], hi);
        memcpy(m->subs + i + 2, nd->subs + i + 1, (size_t)(nd->n - i) * sizeof(Sub));
        return m;
    }
    Node *c = child(ctx, nd, i);
    if (ctx->bail) return NULL;
    if (c == NULL) {
        c = node_new(ctx, layer - 1, 0);
        if (c == NULL) return NULL;
        set_sub(&c->subs[0], NULL);
    }
    Node *put = node_put(ctx, c, key, val, h);
    if (put == NULL) return NULL;
    Node *m = copy_node(ctx, nd);
    if (m == NULL) return NULL;
    set_sub(&m->subs[i], put);
    return m;
}

/* returns 0 and *out (possibly NULL), or -1 on bail */
static int node_delete(Ctx *ctx, Node *nd, Key key, int h, Node **out) {
    int layer = nd->layer;
    int i = bisect_left(nd, key);
    if (h == layer) {
        if (i >= nd->n || key_cmp(nd->keys[i], key) != 0) {
            ctx->bail = 1;
            return -1;
        }
        Node *a = child(ctx, nd, i);
        if (ctx->bail) return -1;
        Node *b = child(ctx, nd, i + 1);
        if (ctx->bail) return -1;
        Node *mid;
        if (merge(ctx, a, b, &mid) < 0) return -1;
        Node *m = node_new(ctx, layer, nd->n - 1);
        if (m == NULL) return -1;
        memcpy(m->keys, nd->keys, (size_t)i * sizeof(Key));
        memcpy(m->keys + i, nd->keys + i + 1, (size_t)(nd->n - i - 1) * sizeof(Key));
        memcpy(m->vals, nd->vals, (size_t)i * sizeof(uint8_t *));
        memcpy(m->vals + i, nd->vals + i + 1, (size_t)(nd->n - i - 1) * sizeof(uint8_t *));
        memcpy(m->subs, nd->subs, (size_t)i * sizeof(Sub));
        set_sub(&m->subs[i], mid);
        memcpy(m->subs + i + 1, nd->subs + i + 2, (size_t)(nd->n - i - 1) * sizeof(Sub));
        *out = prune(m);
        return 0;
    }
    Node *c = child(ctx, nd, i);
    if (ctx->bail) return -1;
    if (c == NULL) {
        ctx->bail = 1;
        return -1;
    }
    Node *sub;
    if (node_delete(ctx, c, key, h, &sub) < 0) return -1;
    Node *m = copy_node(ctx, nd);
    if (m == NULL) return -1;
    set_sub(&m->subs[i], sub);
    *out = prune(m);
    return 0;
}

static Node *empty_node(Ctx *ctx) {
    Node *e = node_new(ctx, 0, 0);
    if (e != NULL) set_sub(&e->subs[0], NULL);
    return e;
}

static Node *root_put(Ctx *ctx, Node *root, Key key, const uint8_t *val, int h) {
    if (h <= root->layer) return node_put(ctx, root, key, val, h);
    Node *lo, *hi;
    int empty = root->n == 0 && root->subs[0].cid == NULL && root->subs[0].node == NULL;
    if (split(ctx, empty ? NULL : root, key, &lo, &hi) < 0) return NULL;
    Node *m = node_new(ctx, h, 1);
    if (m == NULL) return NULL;
    m->keys[0] = key;
    m->vals[0] = val;
    set_sub(&m->subs[0], raise_to(ctx, lo, h - 1));
    set_sub(&m->subs[1], raise_to(ctx, hi, h - 1));
    if (ctx->bail) return NULL;
    return m;
}

static Node *root_delete(Ctx *ctx, Node *root, Key key, int h) {
    if (h > root->layer) return BAIL(ctx);
    Node *nd;
    if (node_delete(ctx, root, key, h, &nd) < 0) return NULL;
    while (nd != NULL && nd->n == 0) {
        nd = child(ctx, nd, 0);
        if (ctx->bail) return NULL;
    }
    return nd != NULL ? nd : empty_node(ctx);
}

/* the node's CID (encoding it, and first every new subtree, if not known) */
static const uint8_t *node_cid(Ctx *ctx, Node *nd) {
    if (nd->has_cid) return nd->cid;
    const uint8_t **links = arena_alloc(&ctx->arena, (size_t)(nd->n + 1) * sizeof(uint8_t *));
    if (links == NULL) {
        PyErr_NoMemory();
        ctx->bail = 2;
        return NULL;
    }
    size_t size = 3 + head_size((uint64_t)nd->n) + 2;
    for (int i = 0; i <= nd->n; i++) {
        Sub *s = &nd->subs[i];
        if (s->node != NULL) {
            links[i] = node_cid(ctx, s->node);
            if (links[i] == NULL) return NULL;
        } else {
            links[i] = s->cid;
        }
        size += links[i] ? 5 + CID_LEN : 1;
    }
    for (int i = 0; i < nd->n; i++) {
        /* a4 "k" bytes(suffix) "p" uint "t" link "v" link; the suffix is at most the key */
        size += 1 + 2 + head_size((uint64_t)nd->keys[i].n) + (size_t)nd->keys[i].n + 2 + 3 + 2 + 2 + 5 + CID_LEN;
    }
    uint8_t *buf = arena_alloc(&ctx->arena, size);
    if (buf == NULL) {
        PyErr_NoMemory();
        ctx->bail = 2;
        return NULL;
    }
    uint8_t *o = buf;
    *o++ = 0xa2;
    *o++ = 0x61;
    *o++ = 'e';
    o = write_head(o, 4, (uint64_t)nd->n);
    Key prev = {NULL, 0};
    for (int i = 0; i < nd->n; i++) {
        Key k = nd->keys[i];
        Py_ssize_t m = prev.n < k.n ? prev.n : k.n, p = 0;
        while (p < m && prev.p[p] == k.p[p]) p++;
        *o++ = 0xa4;
        *o++ = 0x61;
        *o++ = 'k';
        o = write_head(o, 2, (uint64_t)(k.n - p));
        memcpy(o, k.p + p, (size_t)(k.n - p));
        o += k.n - p;
        *o++ = 0x61;
        *o++ = 'p';
        o = write_head(o, 0, (uint64_t)p);
        *o++ = 0x61;
        *o++ = 't';
        if (links[i + 1] == NULL) {
            *o++ = 0xf6;
        } else {
            memcpy(o, LINK_HEAD, 5);
            memcpy(o + 5, links[i + 1], CID_LEN);
            o += 5 + CID_LEN;
        }
        *o++ = 0x61;
        *o++ = 'v';
        memcpy(o, LINK_HEAD, 5);
        memcpy(o + 5, nd->vals[i], CID_LEN);
        o += 5 + CID_LEN;
        prev = k;
    }
    *o++ = 0x61;
    *o++ = 'l';
    if (links[0] == NULL) {
        *o++ = 0xf6;
    } else {
        memcpy(o, LINK_HEAD, 5);
        memcpy(o + 5, links[0], CID_LEN);
        o += 5 + CID_LEN;
    }
    memcpy(nd->cid, DAG_PREFIX, 4);
    sha256(buf, (size_t)(o - buf), nd->cid + 4);
    nd->has_cid = 1;
    return nd->cid;
}

/* ---------------------------------------------------------------------------------------- */
/* invert(blocks, root, ops) -> CID | None                                                    */

typedef struct {
    int action; /* 0 create, 1 update, 2 delete */
    Key key;
    int h;
    const uint8_t *cid;  /* NULL for none */
    const uint8_t *prev; /* NULL for none */
} Op;

static PyObject *s_action, *s_path, *s_cid, *s_prev;

/* reads one op (a RepoOp); 1 ok, 0 not handled here, -1 error set */
static int read_op(Ctx *ctx, PyObject *obj, Op *op) {
    PyObject *action = NULL, *path = NULL, *cid = NULL, *prev = NULL;
    int ok = -1;
    if ((action = PyObject_GetAttr(obj, s_action)) == NULL) goto attr_error;
    if ((path = PyObject_GetAttr(obj, s_path)) == NULL) goto attr_error;
    if ((cid = PyObject_GetAttr(obj, s_cid)) == NULL) goto attr_error;
    if ((prev = PyObject_GetAttr(obj, s_prev)) == NULL) goto attr_error;
    ok = 0;
    if (!PyUnicode_CheckExact(action) || !PyUnicode_CheckExact(path)) goto done;
    if (PyUnicode_CompareWithASCIIString(action, "create") == 0)
        op->action = 0;
    else if (PyUnicode_CompareWithASCIIString(action, "update") == 0)
        op->action = 1;
    else if (PyUnicode_CompareWithASCIIString(action, "delete") == 0)
        op->action = 2;
    else
        goto done;
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(path, &n);
    if (utf8 == NULL) {
        PyErr_Clear(); /* not encodable: the reference reports it */
        goto done;
    }
    if (!valid_key((const uint8_t *)utf8, n)) goto done;
    op->key.p = (const uint8_t *)utf8; /* owned by ``path``, which the op keeps alive */
    op->key.n = n;
    op->h = key_height(op->key.p, n);
    op->cid = cid == Py_None ? NULL : cid_bytes_of(cid);
    if (cid != Py_None && (op->cid == NULL || !is_blessed(op->cid))) goto done;
    op->prev = prev == Py_None ? NULL : cid_bytes_of(prev);
    if (prev != Py_None && (op->prev == NULL || !is_blessed(op->prev))) goto done;
    /* keep the objects whose buffers the op points into */
    if (PyList_Append(ctx->keep, path) < 0 || PyList_Append(ctx->keep, cid) < 0 ||
        PyList_Append(ctx->keep, prev) < 0) {
        ok = -1;
        goto done;
    }
    ok = 1;
    goto done;
attr_error:
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        ok = 0;
    }
done:
    Py_XDECREF(action);
    Py_XDECREF(path);
    Py_XDECREF(cid);
    Py_XDECREF(prev);
    return ok;
}

static PyObject *accel_invert(PyObject *self, PyObject *args) {
    PyObject *blocks, *root, *ops, *seen = Py_None;
    if (!PyArg_ParseTuple(args, "OOO|O:invert", &blocks, &root, &ops, &seen)) return NULL;
    if (seen != Py_None && !PySet_CheckExact(seen)) {
        PyErr_SetString(PyExc_TypeError, "invert: seen must be a set or None");
        return NULL;
    }
    if (CID_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mst._accel.init(CID) was not called");
        return NULL;
    }
    if (!PyDict_CheckExact(blocks) || !(PyList_CheckExact(ops) || PyTuple_CheckExact(ops))) Py_RETURN_NONE;
    Py_ssize_t nops = PySequence_Fast_GET_SIZE(ops);
    if (nops == 0) {
        Py_INCREF(root);
        return root;
    }
    const uint8_t *root_cid = cid_bytes_of(root);
    if (root_cid == NULL) Py_RETURN_NONE;
    Ctx *ctx = ctx_new(blocks, PyList_New(0));
    if (ctx == NULL) return PyErr_NoMemory();
    ctx->track = seen != Py_None;
    PyObject *result = NULL;
    Op *opv = NULL;
    if (ctx->keep == NULL) goto out;
    if (PyList_Append(ctx->keep, ops) < 0) goto out;
    opv = PyMem_Malloc((size_t)nops * sizeof(Op));
    if (opv == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t j = 0; j < nops; j++) {
        int r = read_op(ctx, PySequence_Fast_GET_ITEM(ops, j), &opv[j]);
        if (r < 0) goto out;
        if (r == 0) goto decline;
    }
    int indexed = index_blocks(ctx);
    if (indexed < 0) goto out;
    if (indexed > 0) goto decline;
    Node *nd = load_node(ctx, root_cid, -1);
    if (nd == NULL) goto fail;
    for (Py_ssize_t j = nops - 1; j >= 0; j--) {
        Op *op = &opv[j];
        const uint8_t *current = NULL;
        int found = node_get(ctx, nd, op->key, op->h, &current);
        if (found < 0) goto fail;
        if (op->action == 0) {
            if (!found || op->cid == NULL || memcmp(current, op->cid, CID_LEN) != 0) goto decline;
            nd = root_delete(ctx, nd, op->key, op->h);
        } else if (op->action == 1) {
            if (!found || op->cid == NULL || memcmp(current, op->cid, CID_LEN) != 0 || op->prev == NULL)
                goto decline;
            nd = root_put(ctx, nd, op->key, op->prev, op->h);
        } else {
            if (found || op->prev == NULL) goto decline;
            nd = root_put(ctx, nd, op->key, op->prev, op->h);
        }
        if (nd == NULL) goto fail;
    }
    const uint8_t *cid = node_cid(ctx, nd);
    if (cid == NULL) goto fail;
    result = make_cid(cid);
    for (size_t j = 0; result != NULL && j < ctx->nseen; j++) { /* accepted: the blocks it read */
        PyObject *c = make_cid(ctx->seen[j]);
        if (c == NULL || PySet_Add(seen, c) < 0) Py_CLEAR(result);
        Py_XDECREF(c);
    }
    goto out;
fail:
    if (ctx->bail == 2) goto out; /* a Python error is set */
decline:
    result = Py_None;
    Py_INCREF(result);
out:
    PyMem_Free(opv);
    PyMem_Free(ctx->seen);
    Py_XDECREF(ctx->keep);
    arena_free(&ctx->arena);
    PyMem_Free(ctx);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* records(blocks, root, require_records) -> {path: CID} | None: the whole tree, walked        */

typedef struct {
    Key prev;
    int require_records;
    PyObject *out;
} Walk;

static int block_present(Ctx *ctx, const uint8_t *cid) {
    uint64_t h;
    memcpy(&h, cid + 4, 8);
    size_t i = (size_t)h & ctx->mask;
    while (ctx->table[i].cid != NULL) {
        if (memcmp(ctx->table[i].cid, cid, CID_LEN) == 0) return 1;
        i = (i + 1) & ctx->mask;
    }
    return 0;
}

/* every (key, value) under nd in key order into w->out; 0, or -1 (ctx->bail set) */
static int walk(Ctx *ctx, Node *nd, Walk *w) {
    if (nd == NULL) return 0;
    for (int i = 0; i <= nd->n; i++) {
        Node *c = child(ctx, nd, i);
        if (ctx->bail) return -1;
        if (walk(ctx, c, w) < 0) return -1;
        if (i == nd->n) break;
        Key k = nd->keys[i];
        if (w->prev.p != NULL && key_cmp(k, w->prev) <= 0) {
            ctx->bail = 1; /* keys out of order across nodes */
            return -1;
        }
        w->prev = k;
        if (w->require_records && !block_present(ctx, nd->vals[i])) {
            ctx->bail = 1;
            return -1;
        }
        PyObject *path = PyUnicode_DecodeASCII((const char *)k.p, k.n, NULL);
        PyObject *val = path != NULL ? make_cid(nd->vals[i]) : NULL;
        int r = val != NULL ? PyDict_SetItem(w->out, path, val) : -1;
        Py_XDECREF(path);
        Py_XDECREF(val);
        if (r < 0) {
            ctx->bail = 2;
            return -1;
        }
    }
    return 0;
}

static PyObject *accel_records(PyObject *self, PyObject *args) {
    PyObject *blocks, *root;
    int require_records;
    if (!PyArg_ParseTuple(args, "OOp:records", &blocks, &root, &require_records)) return NULL;
    if (CID_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mst._accel.init(CID) was not called");
        return NULL;
    }
    const uint8_t *root_cid = cid_bytes_of(root);
    if (!PyDict_CheckExact(blocks) || root_cid == NULL) Py_RETURN_NONE;
    Ctx *ctx = ctx_new(blocks, NULL);
    if (ctx == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    Walk w = {{NULL, 0}, require_records, PyDict_New()};
    if (w.out == NULL) goto out;
    /* the walk makes Python objects (so a garbage collection, so arbitrary code, may run): index a
     * private copy of the map, which keeps every block the nodes point into alive */
    if ((ctx->keep = PyDict_Copy(blocks)) == NULL) goto out;
    ctx->blocks = ctx->keep;
    int indexed = index_blocks(ctx);
    if (indexed < 0) goto out;
    if (indexed > 0) goto decline;
    Node *nd = load_node(ctx, root_cid, -1);
    if (nd == NULL) goto fail;
    if (nd->n == 0 && nd->subs[0].cid == NULL) goto done; /* the empty tree */
    if (walk(ctx, nd, &w) < 0) goto fail;
done:
    result = w.out;
    w.out = NULL;
    goto out;
fail:
    if (ctx->bail == 2) goto out;
decline:
    result = Py_None;
    Py_INCREF(result);
out:
    Py_XDECREF(w.out);
    Py_XDECREF(ctx->keep);
    arena_free(&ctx->arena);
    PyMem_Free(ctx);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* read_car(data, max_blocks, max_block_bytes, max_total_bytes) -> (roots, blocks) | None      */

/* unsigned LEB128, minimal, at most 9 bytes (what the reference accepts, narrowed) */
static int read_varint(const uint8_t *d, size_t end, size_t *pos, uint64_t *out) {
    uint64_t v = 0;
    int shift = 0;
    size_t p = *pos;
    for (;;) {
        if (p >= end || shift > 56) return 0;
        uint8_t b = d[p++];
        v |= (uint64_t)(b & 0x7f) << shift;
        if (b < 0x80) {
            if (b == 0 && shift) return 0;
            break;
        }
        shift += 7;
    }
    *pos = p;
    *out = v;
    return 1;
}

static const uint8_t ROOTS_KEY[7] = {0xa2, 0x65, 'r', 'o', 'o', 't', 's'};
static const uint8_t VERSION_1[9] = {0x67, 'v', 'e', 'r', 's', 'i', 'o', 'n', 0x01};

static PyObject *accel_read_car(PyObject *self, PyObject *args) {
    Py_buffer buf;
    long long max_blocks, max_block_bytes, max_total_bytes;
    if (!PyArg_ParseTuple(args, "y*LLL:read_car", &buf, &max_blocks, &max_block_bytes, &max_total_bytes))
        return NULL;
    if (CID_type == NULL) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_RuntimeError, "mst._accel.init(CID) was not called");
        return NULL;
    }
    const uint8_t *d = buf.buf;
    size_t end = (size_t)buf.len, pos = 0;
    PyObject *roots = NULL, *blocks = NULL, *result = NULL;
    uint64_t hlen, nroots, slen;
    if ((long long)end > max_total_bytes) goto decline;
    /* header: exactly {"roots": [dag-cbor links], "version": 1}, canonical */
    if (!read_varint(d, end, &pos, &hlen) || hlen == 0 || hlen > MAX_HEADER_BYTES || hlen > end - pos)
        goto decline;
    size_t hend = pos + hlen;
    if (hend - pos < 7 || memcmp(d + pos, ROOTS_KEY, 7) != 0) goto decline;
    pos += 7;
    if (!read_head(d, hend, &pos, 4, &nroots) || nroots == 0 || nroots > 1000) goto decline;
    if ((roots = PyList_New((Py_ssize_t)nroots)) == NULL) goto out;
    for (uint64_t i = 0; i < nroots; i++) {
        const uint8_t *cid;
        if (!read_link(d, hend, &pos, 0, 1, &cid)) goto decline;
        PyObject *c = make_cid(cid);
        if (c == NULL) goto out;
        PyList_SET_ITEM(roots, (Py_ssize_t)i, c);
    }
    if (hend - pos != 9 || memcmp(d + pos, VERSION_1, 9) != 0) goto decline;
    pos = hend;
    if ((blocks = PyDict_New()) == NULL) goto out;
    long long count = 0;
    while (pos < end) {
        if (!read_varint(d, end, &pos, &slen) || slen > end - pos || slen < CID_LEN) goto decline;
        const uint8_t *cid = d + pos;
        if (!is_blessed(cid) || (long long)(slen - CID_LEN) > max_block_bytes || ++count > max_blocks)
            goto decline;
        const uint8_t *data = cid + CID_LEN;
        size_t n = slen - CID_LEN;
        uint8_t digest[32];
        sha256(data, n, digest);
        if (memcmp(digest, cid + 4, 32) != 0) goto decline;
        PyObject *key = make_cid(cid);
        if (key == NULL) goto out;
        PyObject *block = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)n);
        if (block == NULL) {
            Py_DECREF(key);
            goto out;
        }
        int r = set_cid_item(blocks, key, block);
        Py_DECREF(key);
        Py_DECREF(block);
        if (r < 0) goto out;
        pos += slen;
    }
    result = PyTuple_Pack(2, roots, blocks);
    goto out;
decline:
    result = Py_None;
    Py_INCREF(result);
out:
    Py_XDECREF(roots);
    Py_XDECREF(blocks);
    PyBuffer_Release(&buf);
    return result;
}

/* ---------------------------------------------------------------------------------------- */
/* DAG-CBOR decoding helpers for mst.cbor and mst.commit (same accept-only contract)          */

static PyObject *cid_fallback = NULL; /* mst.cbor's strict CID constructor (the reference) */

/* strict_cid(raw) -> CID: cbrrr's CID constructor for mst.cbor's strict decoding. A blessed
 * 36-byte link becomes a CID holding ``raw`` itself (exactly what ``CID(bytes(raw))`` makes,
 * without running ``CID.__init__``); anything else goes to the reference set by init_cbor,
 * which makes the CID or raises its error. */
static PyObject *accel_strict_cid(PyObject *self, PyObject *raw) {
    if (CID_type != NULL && PyBytes_CheckExact(raw) && PyBytes_GET_SIZE(raw) == CID_LEN &&
        is_blessed((const uint8_t *)PyBytes_AS_STRING(raw))) {
        PyObject *obj = CID_type->tp_alloc(CID_type, 0);
        if (obj == NULL) return NULL;
        Py_INCREF(raw);
        *(PyObject **)((char *)obj + cid_bytes_offset) = raw;
        return obj;
    }
    if (cid_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mst._accel.init_cbor(fallback) was not called");
        return NULL;
    }
    return PyObject_CallOneArg(cid_fallback, raw);
}

static PyObject *accel_init_cbor(PyObject *self, PyObject *fallback) {
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "init_cbor expects the reference CID constructor");
        return NULL;
    }
    Py_INCREF(fallback);
    Py_XSETREF(cid_fallback, fallback);
    Py_RETURN_NONE;
}

#define MAX_VALUE_DEPTH 256 /* mst.cbor.MAX_DEPTH */

/* 1 when every container in ``o`` (an exact dict or list at nesting ``depth``) nests at most
 * MAX_VALUE_DEPTH deep and every exact int in it fits int64 (mst.cbor._check_values' rules; it
 * descends into exact dicts and lists only, as that does); 0 otherwise (the reference decides). */
static int values_ok(PyObject *o, int depth) {
    if (depth > MAX_VALUE_DEPTH) return 0;
    Py_ssize_t pos = 0, i = 0, n = 0;
    int is_dict = PyDict_CheckExact(o);
    if (!is_dict) n = PyList_GET_SIZE(o);
    for (;;) {
        PyObject *c;
        if (is_dict) {
            PyObject *k;
            if (!PyDict_Next(o, &pos, &k, &c)) break;
        } else {
            if (i >= n) break;
            c = PyList_GET_ITEM(o, i++);
        }
        if (PyDict_CheckExact(c) || PyList_CheckExact(c)) {
            if (!values_ok(c, depth + 1)) return 0;
        } else if (PyLong_CheckExact(c)) {
            int overflow = 0;
            (void)PyLong_AsLongLongAndOverflow(c, &overflow);
            if (overflow) return 0;
        }
    }
    return 1;
}

static PyObject *accel_values_ok(PyObject *self, PyObject *obj) {
    if (!(PyDict_CheckExact(obj) || PyList_CheckExact(obj))) Py_RETURN_FALSE;
    return PyBool_FromLong(values_ok(obj, 1));
}

/* did/rev syntax of mst.syntax (is_valid_did: ``did:[a-z]+:[a-zA-Z0-9._:%-]*[a-zA-Z0-9._-]``,
 * at most 2048 characters; is_valid_tid: 13 characters, ``[234567abcdefghij][234567a-z]{12}``) */
static int did_char(uint8_t c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-' || c == ':' || c == '%';
}

static int valid_did(const uint8_t *s, size_t n) {
    if (n > 2048 || n < 4 || memcmp(s, "did:", 4) != 0) return 0;
    size_t i = 4;
    while (i < n && s[i] >= 'a' && s[i] <= 'z') i++;
    if (i == 4 || i >= n || s[i] != ':') return 0;
    i++;
    if (i >= n) return 0;
    for (; i < n; i++)
        if (!did_char(s[i])) return 0;
    return s[n - 1] != ':' && s[n - 1] != '%';
}

static int valid_tid(const uint8_t *s, size_t n) {
    if (n != 13) return 0;
    if (!((s[0] >= '2' && s[0] <= '7') || (s[0] >= 'a' && s[0] <= 'j'))) return 0;
    for (size_t i = 1; i < 13; i++)
        if (!((s[i] >= '2' && s[i] <= '7') || (s[i] >= 'a' && s[i] <= 'z'))) return 0;
    return 1;
}

/* a text key given as its full encoding (head + bytes) at *pos */
static int read_raw(const uint8_t *d, size_t end, size_t *pos, const char *raw, size_t n) {
    if (*pos + n > end || memcmp(d + *pos, raw, n) != 0) return 0;
    *pos += n;
    return 1;
}

/* commit(block) -> (did, version, data, rev, prev, sig, signed) | None: a version-3 commit block
 * in its canonical encoding (keys did, rev, sig, data, prev, version; minimal heads; did and rev
 * valid; data and prev dag-cbor links, prev possibly null): exactly the fields
 * mst.commit.decode_commit gives it, and the bytes that are signed (the canonical encoding of the
 * commit without sig, which is the block without its sig entry); None for anything else. */
static PyObject *accel_commit(PyObject *self, PyObject *arg) {
    if (CID_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mst._accel.init(CID) was not called");
        return NULL;
    }
    if (!PyBytes_CheckExact(arg)) Py_RETURN_NONE;
    const uint8_t *d = (const uint8_t *)PyBytes_AS_STRING(arg);
    size_t end = (size_t)PyBytes_GET_SIZE(arg), pos = 0;
    uint64_t did_n, rev_n, sig_n;
    const uint8_t *did, *rev, *sig, *data, *prev;
    if (end < 1 || d[0] != 0xa6) Py_RETURN_NONE;
    pos = 1;
    if (!read_raw(d, end, &pos, "\x63" "did", 4) || !read_head(d, end, &pos, 3, &did_n) || did_n > end - pos)
        Py_RETURN_NONE;
    did = d + pos;
    pos += did_n;
    if (!read_raw(d, end, &pos, "\x63" "rev", 4) || !read_head(d, end, &pos, 3, &rev_n) || rev_n > end - pos)
        Py_RETURN_NONE;
    rev = d + pos;
    pos += rev_n;
    size_t sig_start = pos;
    if (!read_raw(d, end, &pos, "\x63" "sig", 4) || !read_head(d, end, &pos, 2, &sig_n) || sig_n > end - pos)
        Py_RETURN_NONE;
    sig = d + pos;
    pos += sig_n;
    size_t sig_end = pos;
    if (!read_raw(d, end, &pos, "\x64" "data", 5) || !read_link(d, end, &pos, 0, 1, &data)) Py_RETURN_NONE;
    if (!read_raw(d, end, &pos, "\x64" "prev", 5) || !read_link(d, end, &pos, 1, 1, &prev)) Py_RETURN_NONE;
    if (!read_raw(d, end, &pos, "\x67" "version" "\x03", 9) || pos != end) Py_RETURN_NONE;
    if (!valid_did(did, did_n) || !valid_tid(rev, rev_n)) Py_RETURN_NONE;
    PyObject *did_s = NULL, *rev_s = NULL, *sig_b = NULL, *data_c = NULL, *prev_c = NULL, *result = NULL;
    PyObject *unsigned_b = NULL;
    /* the signed bytes: this canonical block without its sig entry (5 entries, same order) */
    size_t un = end - (sig_end - sig_start);
    if ((unsigned_b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)un)) == NULL) goto out;
    uint8_t *u = (uint8_t *)PyBytes_AS_STRING(unsigned_b);
    u[0] = 0xa5;
    memcpy(u + 1, d + 1, sig_start - 1);
    memcpy(u + sig_start, d + sig_end, end - sig_end);
    if ((did_s = PyUnicode_DecodeASCII((const char *)did, (Py_ssize_t)did_n, NULL)) == NULL) goto out;
    if ((rev_s = PyUnicode_DecodeASCII((const char *)rev, (Py_ssize_t)rev_n, NULL)) == NULL) goto out;
    if ((sig_b = PyBytes_FromStringAndSize((const char *)sig, (Py_ssize_t)sig_n)) == NULL) goto out;
    if ((data_c = make_cid(data)) == NULL) goto out;
    if (prev == NULL) {
        prev_c = Py_None;
        Py_INCREF(prev_c);
    } else if ((prev_c = make_cid(prev)) == NULL) {
        goto out;
    }
    result = Py_BuildValue("(OiOOOOO)", did_s, 3, data_c, rev_s, prev_c, sig_b, unsigned_b);
out:
    Py_XDECREF(unsigned_b);
    Py_XDECREF(did_s);
    Py_XDECREF(rev_s);
    Py_XDECREF(sig_b);
    Py_XDECREF(data_c);
    Py_XDECREF(prev_c);
    return result;
}

/* ---------------------------------------------------------------------------------------- */

static PyObject *accel_init(PyObject *self, PyObject *cid_type) {
    if (!PyType_Check(cid_type)) {
        PyErr_SetString(PyExc_TypeError, "init expects the CID class");
        return NULL;
    }
    PyObject *descr = PyDict_GetItemString(((PyTypeObject *)cid_type)->tp_dict, "cid_bytes");
    if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type) {
        PyErr_SetString(PyExc_TypeError, "CID must have a cid_bytes slot");
        return NULL;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX) {
        PyErr_SetString(PyExc_TypeError, "CID.cid_bytes is not an object slot");
        return NULL;
    }
    Py_INCREF(cid_type);
    Py_XDECREF(CID_type);
    CID_type = (PyTypeObject *)cid_type;
    cid_bytes_offset = member->offset;
    /* does hash(CID(b)) == hash(b)? (a sample; cbrrr.CID defines it so) */
    static const uint8_t sample[CID_LEN] = {0x01, 0x71, 0x12, 0x20, 7, 1, 2, 3};
    PyObject *probe = make_cid(sample);
    if (probe == NULL) return NULL;
    Py_hash_t hc = PyObject_Hash(probe);
    Py_hash_t hb = hc == -1 ? -1 : PyObject_Hash(*(PyObject **)((char *)probe + cid_bytes_offset));
    Py_DECREF(probe);
    if (hb == -1) return NULL;
    cid_hash_is_bytes_hash = hc == hb;
    Py_RETURN_NONE;
}

static PyObject *accel_key_height(PyObject *self, PyObject *arg) {
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "key_height expects bytes");
        return NULL;
    }
    const uint8_t *k = (const uint8_t *)PyBytes_AS_STRING(arg);
    Py_ssize_t n = PyBytes_GET_SIZE(arg);
    if (!valid_key(k, n)) return PyLong_FromLong(-1);
    return PyLong_FromLong(key_height(k, n));
}

static PyMethodDef methods[] = {
    {"init", accel_init, METH_O, "init(CID): the CID class the results are made of (cbrrr.CID)."},
    {"read_car", accel_read_car, METH_VARARGS,
     "read_car(data, max_blocks, max_block_bytes, max_total_bytes) -> (roots, blocks) or None."},
    {"invert", accel_invert, METH_VARARGS,
     "invert(blocks, root, ops, seen=None) -> CID or None; when accepted, adds the CIDs of the blocks it read to "
     "the set ``seen``."},
    {"records", accel_records, METH_VARARGS,
     "records(blocks, root, require_records) -> {path: CID} of the whole tree, or None."},
    {"checked_height", accel_key_height, METH_O, "Height of a valid MST key, -1 if invalid."},
    {"init_cbor", accel_init_cbor, METH_O,
     "init_cbor(fallback): the reference strict CID constructor strict_cid hands what it declines."},
    {"strict_cid", accel_strict_cid, METH_O, "strict_cid(raw) -> CID (mst.cbor's CID constructor)."},
    {"values_ok", accel_values_ok, METH_O,
     "values_ok(obj) -> True if nesting <= 256 and every int fits int64 (False: the reference decides)."},
    {"commit", accel_commit, METH_O,
     "commit(block) -> (did, version, data, rev, prev, sig, signed bytes) of a canonical commit block, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mst._accel",
    "The native verification path (see mst/_accel.c and mst/accel.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__accel(void) {
    const char *ok = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_~:.-";
    for (const char *c = ok; *c; c++) key_char_ok[(uint8_t)*c] = 1;
    s_action = PyUnicode_InternFromString("action");
    s_path = PyUnicode_InternFromString("path");
    s_cid = PyUnicode_InternFromString("cid");
    s_prev = PyUnicode_InternFromString("prev");
    if (!s_action || !s_path || !s_cid || !s_prev) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "BUILT_FROM_SHA256", ACCEL_SOURCE_SHA256) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
