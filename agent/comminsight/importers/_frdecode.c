/* Flight Recorder pickles straight into columns, without a Python object per entry.
 *
 * decode(data, max_bytes) reads one pickled dump and returns
 *   (top, n, ints, valid, codes, distinct)
 * where top is the dump as a dict without "entries", n the number of entries, ints the 7 integer
 * fields of INT_FIELDS as int64 (column after column), valid one byte per value (0: None or absent),
 * codes the 6 fields of CODED_FIELDS as int32 codes (column after column, -1: absent) into distinct,
 * a tuple of 6 lists holding each field's distinct values as the unpickler would have made them.
 *
 * It returns None, having built nothing that stays, for anything outside the plain subset it knows:
 * opcodes other than containers, text, integers, floats, booleans, None and the memo; a list or
 * dict referred to twice; an integer field that is not an int64 or None; nesting past MAX_DEPTH;
 * a dump whose objects, as Python would make them, or whose decoding tables would pass max_bytes.
 * The caller then reads the file with the restricted Python unpickler, which gives the same table
 * or the same error as before. One exception: a memo index past the end of the data, which it
 * returns (an int) for the caller to refuse, since the C unpickler would allocate 16 bytes per index. Nothing here calls back into Python except to build the result.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 64

enum { T_NONE, T_TRUE, T_FALSE, T_INT, T_FLOAT, T_STR, T_LIST, T_TUPLE, T_DICT };

typedef struct {
    int64_t v;    /* T_INT: value; T_FLOAT: bits; T_STR: offset in data; containers: first ref */
    int32_t tail; /* containers: last ref (-1: none) */
    uint32_t n;   /* T_STR: bytes; containers: refs (a dict holds key and value refs) */
    uint8_t type;
    uint8_t leaves; /* T_TUPLE: every item is a scalar or text */
} Node;

typedef struct {
    int32_t node;
    int32_t next;
} Ref;

typedef struct {
    char *p;
    size_t len, cap;
} Buf;

typedef struct {
    uint64_t hash;
    size_t at, len; /* the key in the key arena */
    int32_t code;
} Slot;

typedef struct {
    Slot *slots;
    size_t cap, used;
    int32_t *first; /* per code: the node it was first seen as */
    size_t firstcap;
    int32_t last_node, last_code; /* the previous entry's value (memoised text repeats) */
} Table;

typedef struct {
    const unsigned char *data;
    size_t size;
    Node *nodes;
    size_t nnodes, nodecap;
    Ref *refs;
    size_t nrefs, refcap;
    int32_t *stack;
    size_t nstack, stackcap;
    size_t *marks;
    size_t nmarks, markcap;
    int32_t *memo;
    size_t memocap, memolen;
    size_t python_bytes; /* what the unpickled objects would take in Python, over-estimated */
    size_t max_bytes;
    size_t work, max_work; /* bytes of value keys made, objects converted */
    uint64_t bad_memo;     /* a memo index past the end of the data (0: none) */
    Buf keys, scratch;
} Ctx;

static size_t table_bytes(Ctx *c) {
    return c->nodecap * sizeof(Node) + c->refcap * sizeof(Ref) + c->stackcap * 4 + c->markcap * sizeof(size_t) +
           c->memocap * 4 + c->keys.cap + c->scratch.cap;
}

/* Grows *p (of *cap items of size item) to hold need items; 0 when over the memory bound. */
static int grow_slow(Ctx *c, void **p, size_t *cap, size_t need, size_t item) {
    size_t n = *cap ? *cap : 64;
    while (n < need) n *= 2;
    if (table_bytes(c) + (n - *cap) * item > c->max_bytes) return 0;
    void *q = realloc(*p, n * item);
    if (!q) return 0;
    *p = q;
    *cap = n;
    return 1;
}

#define grow(c, p, cap, need, item) ((need) <= *(cap) || grow_slow((c), (p), (cap), (need), (item)))

static int32_t new_node(Ctx *c, uint8_t type, int64_t v, uint32_t n, size_t python_bytes) {
    if (c->nnodes >= INT32_MAX) return -1;
    if (!grow(c, (void **)&c->nodes, &c->nodecap, c->nnodes + 1, sizeof(Node))) return -1;
    c->python_bytes += python_bytes;
    if (c->python_bytes > c->max_bytes) return -1;
    Node *node = &c->nodes[c->nnodes];
    node->v = v;
    node->n = n;
    node->tail = -1;
    node->type = type;
    node->leaves = 1;
    return (int32_t)c->nnodes++;
}

static int push(Ctx *c, int32_t node) {
    if (node < 0) return 0;
    if (!grow(c, (void **)&c->stack, &c->stackcap, c->nstack + 1, 4)) return 0;
    c->stack[c->nstack++] = node;
    return 1;
}

static int is_container(uint8_t t) { return t == T_LIST || t == T_TUPLE || t == T_DICT; }

static int add_ref(Ctx *c, int32_t parent, int32_t child) {
    if (c->nrefs >= INT32_MAX) return 0;
    const Node *k = &c->nodes[child];
    /* A dict key that is a list, a dict or a tuple holding either: unhashable, unpickling fails. */
    if (c->nodes[parent].type == T_DICT && c->nodes[parent].n % 2 == 0 &&
        (k->type == T_LIST || k->type == T_DICT || (k->type == T_TUPLE && !k->leaves)))
        return 0;
    if (!grow(c, (void **)&c->refs, &c->refcap, c->nrefs + 1, sizeof(Ref))) return 0;
    Node *p = &c->nodes[parent];
    int32_t r = (int32_t)c->nrefs++;
    c->refs[r].node = child;
    c->refs[r].next = -1;
    if (p->tail < 0)
        p->v = r;
    else
        c->refs[p->tail].next = r;
    p->tail = r;
    p->n++;
    if (is_container(c->nodes[child].type)) p->leaves = 0;
    /* A slot in a list (with its over-allocation), a tuple or a dict (entry and index, half-filled). */
    c->python_bytes += p->type == T_DICT ? 40 : p->type == T_LIST ? 12 : 8;
    return c->python_bytes <= c->max_bytes;
}

static size_t str_bytes(const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] >= 0x80) return 80 + 4 * n; /* up to four bytes a character once decoded */
    return 64 + n;
}

/* A text of n bytes at data[at]; 0 when it is not UTF-8 as the unpickler reads it (surrogates pass). */
static int32_t new_str(Ctx *c, size_t at, size_t n) {
    const unsigned char *s = c->data + at;
    size_t i = 0;
    while (i < n && s[i] < 0x80) i++;
    if (i < n) {
        PyObject *check = PyUnicode_DecodeUTF8((const char *)s, (Py_ssize_t)n, "surrogatepass");
        if (!check) {
            PyErr_Clear();
            return -1;
        }
        Py_DECREF(check);
    }
    return new_node(c, T_STR, (int64_t)at, (uint32_t)n, str_bytes(s, n));
}

/* The stack's floor: an opcode other than the mark-taking ones may not reach below the last MARK
 * (the unpickler's "unexpected MARK found"). */
static size_t fence(const Ctx *c) { return c->nmarks ? c->marks[c->nmarks - 1] : 0; }

static int memo_put(Ctx *c, size_t index) {
    if (c->nstack <= fence(c)) return 0;
    /* More memo slots than the pickle has bytes, or than the memory bound allows at 16 bytes each: no
     * pickler writes that, and the C unpickler would zero a memo table of 16 bytes per index at once,
     * out of reach of any input-side watch. */
    if (index > c->size || index > c->max_bytes / 16) {
        c->bad_memo = index;
        return 0;
    }
    if (index > c->nnodes + 1024) return 0; /* a sparse memo: not what a pickler writes */
    size_t old = c->memocap;
    if (!grow(c, (void **)&c->memo, &c->memocap, index + 1, 4)) return 0;
    for (size_t i = old; i < c->memocap; i++) c->memo[i] = -1;
    if (c->memo[index] < 0) c->memolen++;
    c->memo[index] = c->stack[c->nstack - 1];
    c->python_bytes += 16;
    return c->python_bytes <= c->max_bytes;
}

static int memo_get(Ctx *c, size_t index) {
    if (index >= c->memocap || c->memo[index] < 0) return 0;
    int32_t node = c->memo[index];
    Node *n = &c->nodes[node];
    /* A list or dict referred to twice, or a tuple of containers: left to the Python reader's checks. */
    if (n->type == T_LIST || n->type == T_DICT || (n->type == T_TUPLE && !n->leaves)) return 0;
    return push(c, node);
}

static int pop_mark(Ctx *c, size_t *mark) {
    if (!c->nmarks) return 0;
    *mark = c->marks[--c->nmarks];
    return 1;
}

static int64_t le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return (int64_t)v;
}

/* Runs the opcodes; the top-level object's node, or -1 when the pickle is outside the subset. */
static int32_t parse(Ctx *c) {
    const unsigned char *d = c->data;
    size_t at = 0, size = c->size;
#define NEED(k)                     \
    do {                            \
        if (size - at < (k)) return -1; \
    } while (0)
    while (at < size) {
        unsigned char op = d[at++];
        switch (op) {
        case 0x80: /* PROTO */
            NEED(1);
            if (d[at] < 2 || d[at] > 5) return -1;
            at++;
            break;
        case 0x95: { /* FRAME: a hint for readers that prefetch; its bytes must be there */
            NEED(8);
            uint64_t n = (uint64_t)le(d + at, 8);
            at += 8;
            if (n > size - at) return -1;
            break;
        }
        case 'N':
            if (!push(c, 0)) return -1;
            break;
        case 0x88: /* NEWTRUE */
            if (!push(c, 1)) return -1;
            break;
        case 0x89: /* NEWFALSE */
            if (!push(c, 2)) return -1;
            break;
        case 'J':
            NEED(4);
            if (!push(c, new_node(c, T_INT, (int32_t)(uint32_t)le(d + at, 4), 0, 32))) return -1;
            at += 4;
            break;
        case 'K': {
            NEED(1);
            int64_t v = d[at++];
            if (!push(c, new_node(c, T_INT, v, 0, v > 256 ? 32 : 0))) return -1;
            break;
        }
        case 'M':
            NEED(2);
            if (!push(c, new_node(c, T_INT, le(d + at, 2), 0, 32))) return -1;
            at += 2;
            break;
        case 0x8a: /* LONG1 */
        case 0x8b: { /* LONG4 */
            size_t width = op == 0x8a ? 1 : 4;
            NEED(width);
            size_t n = (size_t)(uint64_t)le(d + at, (int)width);
            if (op == 0x8b && (int64_t)(int32_t)(uint32_t)n < 0) return -1;
            at += width;
            if (n > 8) return -1; /* past int64: left to Python */
            NEED(n);
            int64_t v = 0;
            if (n) {
                v = le(d + at, (int)n);
                if (n < 8 && (d[at + n - 1] & 0x80)) v -= (int64_t)1 << (8 * n); /* two's complement */
            }
            at += n;
            if (!push(c, new_node(c, T_INT, v, 0, 40))) return -1;
            break;
        }
        case 'G': {
            NEED(8);
            uint64_t bits = 0;
            for (int i = 0; i < 8; i++) bits = (bits << 8) | d[at + i];
            at += 8;
            if (!push(c, new_node(c, T_FLOAT, (int64_t)bits, 0, 24))) return -1;
            break;
        }
        case 'X':
        case 0x8c:   /* SHORT_BINUNICODE */
        case 0x8d: { /* BINUNICODE8 */
            size_t width = op == 'X' ? 4 : op == 0x8c ? 1 : 8;
            NEED(width);
            uint64_t n = (uint64_t)le(d + at, (int)width);
            at += width;
            if (n > size - at || n > UINT32_MAX) return -1;
            if (!push(c, new_str(c, at, (size_t)n))) return -1;
            at += n;
            break;
        }
        case '}':
            if (!push(c, new_node(c, T_DICT, 0, 0, 120))) return -1;
            break;
        case ']':
            if (!push(c, new_node(c, T_LIST, 0, 0, 72))) return -1;
            break;
        case ')':
            if (!push(c, new_node(c, T_TUPLE, 0, 0, 0))) return -1;
            break;
        case '(':
            if (!grow(c, (void **)&c->marks, &c->markcap, c->nmarks + 1, sizeof(size_t))) return -1;
            c->marks[c->nmarks++] = c->nstack;
            break;
        case 't':
        case 0x85: /* TUPLE1 */
        case 0x86: /* TUPLE2 */
        case 0x87: /* TUPLE3 */
        case 'l':
        case 'd': {
            size_t from;
            if (op == 't' || op == 'l' || op == 'd') {
                if (!pop_mark(c, &from)) return -1;
            } else {
                size_t k = (size_t)(op - 0x84);
                if (c->nstack < fence(c) + k) return -1;
                from = c->nstack - k;
            }
            if (op == 'd' && (c->nstack - from) % 2) return -1;
            uint8_t type = op == 'l' ? T_LIST : op == 'd' ? T_DICT : T_TUPLE;
            int32_t node = new_node(c, type, 0, 0, type == T_TUPLE ? 56 : type == T_LIST ? 72 : 120);
            if (node < 0) return -1;
            for (size_t i = from; i < c->nstack; i++)
                if (!add_ref(c, node, c->stack[i])) return -1;
            c->nstack = from;
            if (!push(c, node)) return -1;
            break;
        }
        case 'a':
        case 'e':
        case 's':
        case 'u': {
            size_t from, k = op == 'a' ? 1 : 2;
            if (op == 'a' || op == 's') {
                if (c->nstack < fence(c) + k + 1) return -1; /* the target and its items above the fence */
                from = c->nstack - k;
            } else {
                if (!pop_mark(c, &from)) return -1;
                if (from <= fence(c)) return -1; /* the target above the fence the mark leaves */
            }
            int32_t target = c->stack[from - 1];
            uint8_t want = (op == 'a' || op == 'e') ? T_LIST : T_DICT;
            if (c->nodes[target].type != want) return -1;
            if (want == T_DICT && (c->nstack - from) % 2) return -1;
            for (size_t i = from; i < c->nstack; i++)
                if (!add_ref(c, target, c->stack[i])) return -1;
            c->nstack = from;
            break;
        }
        case 'q':
            NEED(1);
            if (!memo_put(c, d[at++])) return -1;
            break;
        case 'r':
            NEED(4);
            if (!memo_put(c, (size_t)(uint32_t)le(d + at, 4))) return -1;
            at += 4;
            break;
        case 0x94: /* MEMOIZE */
            if (!memo_put(c, c->memolen)) return -1;
            break;
        case 'h':
            NEED(1);
            if (!memo_get(c, d[at++])) return -1;
            break;
        case 'j':
            NEED(4);
            if (!memo_get(c, (size_t)(uint32_t)le(d + at, 4))) return -1;
            at += 4;
            break;
        case '.':
            if (c->nstack != 1 || c->nmarks) return -1;
            return c->stack[0];
        default:
            return -1; /* globals, reduce, bytes, sets, persistent ids, protocol-0 text...: Python decides */
        }
    }
#undef NEED
    return -1;
}

static int buf_put(Ctx *c, Buf *b, const void *p, size_t n) {
    if (!grow(c, (void **)&b->p, &b->cap, b->len + n, 1)) return 0;
    memcpy(b->p + b->len, p, n);
    b->len += n;
    c->work += n;
    return c->work <= c->max_work;
}

/* A value's structure and contents as bytes: equal keys, equal values (types included). */
static int key_of(Ctx *c, Buf *b, int32_t idx, int depth) {
    if (depth > MAX_DEPTH) return 0;
    const Node *n = &c->nodes[idx];
    unsigned char tag = (unsigned char)n->type;
    if (!buf_put(c, b, &tag, 1)) return 0;
    switch (n->type) {
    case T_NONE:
    case T_TRUE:
    case T_FALSE:
        return 1;
    case T_INT:
    case T_FLOAT:
        return buf_put(c, b, &n->v, 8);
    case T_STR:
        return buf_put(c, b, &n->n, 4) && buf_put(c, b, c->data + n->v, n->n);
    default: {
        if (!buf_put(c, b, &n->n, 4)) return 0;
        uint32_t count = n->n;
        for (int32_t r = count ? (int32_t)n->v : -1; r >= 0; r = c->refs[r].next)
            if (!key_of(c, b, c->refs[r].node, depth + 1)) return 0;
        return 1;
    }
    }
}

static uint64_t hash_bytes(const char *p, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ n, w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdULL;
        h ^= h >> 32;
    }
    w = 0;
    memcpy(&w, p, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ULL;
    return h ^ (h >> 29);
}

/* The code of node idx's value in t (a new code for a value not seen before); -1 on failure. */
static int32_t encode(Ctx *c, Table *t, int32_t idx) {
    if (idx == t->last_node) return t->last_code;
    c->scratch.len = 0;
    if (!key_of(c, &c->scratch, idx, 0)) return -1;
    uint64_t h = hash_bytes(c->scratch.p, c->scratch.len);
    if ((t->used + 1) * 2 > t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 64;
        if (table_bytes(c) + cap * sizeof(Slot) > c->max_bytes) return -1;
        Slot *slots = calloc(cap, sizeof(Slot));
        if (!slots) return -1;
        for (size_t i = 0; i < t->cap; i++) {
            if (!t->slots[i].len) continue;
            size_t j = t->slots[i].hash & (cap - 1);
            while (slots[j].len) j = (j + 1) & (cap - 1);
            slots[j] = t->slots[i];
        }
        free(t->slots);
        t->slots = slots;
        t->cap = cap;
    }
    size_t j = h & (t->cap - 1);
    while (t->slots[j].len) {
        Slot *s = &t->slots[j];
        if (s->hash == h && s->len == c->scratch.len && !memcmp(c->keys.p + s->at, c->scratch.p, s->len)) {
            t->last_node = idx;
            t->last_code = s->code;
            return s->code;
        }
        j = (j + 1) & (t->cap - 1);
    }
    size_t at = c->keys.len;
    if (!buf_put(c, &c->keys, c->scratch.p, c->scratch.len)) return -1;
    if (!grow(c, (void **)&t->first, &t->firstcap, t->used + 1, 4)) return -1;
    t->slots[j].hash = h;
    t->slots[j].at = at;
    t->slots[j].len = c->scratch.len; /* never 0: a key holds its tag */
    t->slots[j].code = (int32_t)t->used;
    t->first[t->used] = idx;
    t->last_node = idx;
    t->last_code = (int32_t)t->used;
    return (int32_t)t->used++;
}

/* The Python object the unpickler would have made of node idx; NULL (no error set) on failure. */
static PyObject *to_py(Ctx *c, int32_t idx, int depth) {
    if (depth > MAX_DEPTH || ++c->work > c->max_work) return NULL;
    const Node *n = &c->nodes[idx];
    PyObject *o = NULL;
    switch (n->type) {
    case T_NONE:
        Py_RETURN_NONE;
    case T_TRUE:
        Py_RETURN_TRUE;
    case T_FALSE:
        Py_RETURN_FALSE;
    case T_INT:
        o = PyLong_FromLongLong(n->v);
        break;
    case T_FLOAT: {
        double x;
        memcpy(&x, &n->v, 8);
        o = PyFloat_FromDouble(x);
        break;
    }
    case T_STR:
        o = PyUnicode_DecodeUTF8((const char *)c->data + n->v, n->n, "surrogatepass");
        break;
    case T_LIST:
    case T_TUPLE: {
        o = n->type == T_LIST ? PyList_New(n->n) : PyTuple_New(n->n);
        if (!o) break;
        Py_ssize_t i = 0;
        for (int32_t r = n->n ? (int32_t)n->v : -1; r >= 0; r = c->refs[r].next, i++) {
            PyObject *item = to_py(c, c->refs[r].node, depth + 1);
            if (!item) {
                Py_CLEAR(o);
                break;
            }
            if (n->type == T_LIST)
                PyList_SET_ITEM(o, i, item);
            else
                PyTuple_SET_ITEM(o, i, item);
        }
        break;
    }
    case T_DICT: {
        o = PyDict_New();
        if (!o) break;
        for (int32_t r = n->n ? (int32_t)n->v : -1; r >= 0; r = c->refs[c->refs[r].next].next) {
            PyObject *k = to_py(c, c->refs[r].node, depth + 1);
            PyObject *v = k ? to_py(c, c->refs[c->refs[r].next].node, depth + 1) : NULL;
            int bad = !v || PyDict_SetItem(o, k, v) < 0; /* an unhashable key fails as it would unpickling */
            Py_XDECREF(k);
            Py_XDECREF(v);
            if (bad) {
                Py_CLEAR(o);
                break;
            }
        }
        break;
    }
    }
    if (!o) PyErr_Clear();
    return o;
}

static int str_is(const Ctx *c, const Node *n, const char *s, size_t len) {
    return n->type == T_STR && n->n == len && !memcmp(c->data + n->v, s, len);
}

#define N_INT 7
#define N_CODED 6
static const char *INT_FIELDS[N_INT] = {"record_id",
                                        "pg_id",
                                        "collective_seq_id",
                                        "p2p_seq_id",
                                        "time_created_ns",
                                        "time_discovered_started_ns",
                                        "time_discovered_completed_ns"};
static const char *CODED_FIELDS[N_CODED] = {"process_group", "profiling_name", "is_p2p",
                                            "state",         "input_sizes",    "input_dtypes"};

static int field_named(const Ctx *c, const Node *key) {
    if (key->type != T_STR) return -1;
    for (int f = 0; f < N_INT; f++)
        if (str_is(c, key, INT_FIELDS[f], strlen(INT_FIELDS[f]))) return f;
    for (int f = 0; f < N_CODED; f++)
        if (str_is(c, key, CODED_FIELDS[f], strlen(CODED_FIELDS[f]))) return N_INT + f;
    return -1;
}

/* Entries' keys are memoised texts, the same few nodes again and again: their fields are cached. */
#define KEY_CACHE 256
typedef struct {
    int32_t node[KEY_CACHE];
    int8_t field[KEY_CACHE];
} KeyCache;

static int field_of(const Ctx *c, KeyCache *cache, int32_t idx) {
    unsigned slot = (unsigned)idx % KEY_CACHE;
    if (cache->node[slot] == idx) return cache->field[slot];
    int f = field_named(c, &c->nodes[idx]);
    cache->node[slot] = idx;
    cache->field[slot] = (int8_t)f;
    return f;
}

/* The decoding tables of the last call, kept for the next while they are small (no page faults to
 * grow them again for every file of a directory). Every call holds the GIL throughout. */
#define KEEP_BYTES (32u << 20)
static Ctx spare;

static void ctx_take_spare(Ctx *c) {
    c->nodes = spare.nodes, c->nodecap = spare.nodecap;
    c->refs = spare.refs, c->refcap = spare.refcap;
    c->stack = spare.stack, c->stackcap = spare.stackcap;
    c->marks = spare.marks, c->markcap = spare.markcap;
    c->memo = spare.memo, c->memocap = spare.memocap;
    c->keys.p = spare.keys.p, c->keys.cap = spare.keys.cap;
    c->scratch.p = spare.scratch.p, c->scratch.cap = spare.scratch.cap;
    if (c->memo) memset(c->memo, 0xff, c->memocap * sizeof *c->memo);
    memset(&spare, 0, sizeof spare);
}

static void ctx_free(Ctx *c, Table *tables) {
    for (int f = 0; f < N_CODED; f++) {
        free(tables[f].slots);
        free(tables[f].first);
    }
    if (table_bytes(c) <= KEEP_BYTES && !spare.nodes && !spare.refs && !spare.stack && !spare.marks && !spare.memo &&
        !spare.keys.p && !spare.scratch.p) {
        spare.nodes = c->nodes, spare.nodecap = c->nodecap;
        spare.refs = c->refs, spare.refcap = c->refcap;
        spare.stack = c->stack, spare.stackcap = c->stackcap;
        spare.marks = c->marks, spare.markcap = c->markcap;
        spare.memo = c->memo, spare.memocap = c->memocap;
        spare.keys.p = c->keys.p, spare.keys.cap = c->keys.cap;
        spare.scratch.p = c->scratch.p, spare.scratch.cap = c->scratch.cap;
        return;
    }
    free(c->nodes);
    free(c->refs);
    free(c->stack);
    free(c->marks);
    free(c->memo);
    free(c->keys.p);
    free(c->scratch.p);
}

/* Fills the columns from the entries list node; 0 when an entry is outside the subset. */
static int columns(Ctx *c, int32_t entries, int64_t *ints, char *valid, int32_t *codes, Table *tables) {
    size_t n = c->nodes[entries].n, e = 0;
    KeyCache cache;
    memset(cache.node, 0xff, sizeof cache.node);
    for (int32_t r = n ? (int32_t)c->nodes[entries].v : -1; r >= 0; r = c->refs[r].next, e++) {
        const Node *entry = &c->nodes[c->refs[r].node];
        if (entry->type != T_DICT) return 0;
        int32_t value[N_INT + N_CODED];
        for (int f = 0; f < N_INT + N_CODED; f++) value[f] = -1;
        for (int32_t k = entry->n ? (int32_t)entry->v : -1; k >= 0; k = c->refs[c->refs[k].next].next) {
            const Node *key = &c->nodes[c->refs[k].node];
            if (is_container(key->type)) return 0; /* unhashable, or not a key a dump has: Python decides */
            int f = field_of(c, &cache, c->refs[k].node);
            if (f >= 0) value[f] = c->refs[c->refs[k].next].node; /* a repeated key: the last one counts */
        }
        for (int f = 0; f < N_INT; f++) {
            const Node *v = value[f] >= 0 ? &c->nodes[value[f]] : NULL;
            if (v && v->type != T_INT && v->type != T_NONE) return 0;
            ints[f * n + e] = v && v->type == T_INT ? v->v : 0;
            valid[f * n + e] = v && v->type == T_INT;
        }
        for (int f = 0; f < N_CODED; f++) {
            int32_t code = value[N_INT + f] >= 0 ? encode(c, &tables[f], value[N_INT + f]) : -1;
            if (value[N_INT + f] >= 0 && code < 0) return 0;
            codes[f * n + e] = code;
        }
    }
    return 1;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    Py_ssize_t max_bytes;
    if (!PyArg_ParseTuple(args, "y*n", &buf, &max_bytes)) return NULL;
    Ctx c;
    memset(&c, 0, sizeof c);
    ctx_take_spare(&c);
    Table tables[N_CODED];
    memset(tables, 0, sizeof tables);
    for (int f = 0; f < N_CODED; f++) tables[f].last_node = -1;
    c.data = buf.buf;
    c.size = (size_t)buf.len;
    c.max_bytes = max_bytes > 0 ? (size_t)max_bytes : 0;
    c.max_work = 16 * c.size + (1 << 20);
    PyObject *result = NULL, *top = NULL, *ints = NULL, *valid = NULL, *codes = NULL, *distinct = NULL;
    /* None, True and False: one node each, shared. */
    if (new_node(&c, T_NONE, 0, 0, 0) < 0 || new_node(&c, T_TRUE, 0, 0, 0) < 0 || new_node(&c, T_FALSE, 0, 0, 0) < 0)
        goto out;
    int32_t root = parse(&c);
    if (root < 0 || c.nodes[root].type != T_DICT) goto out;
    /* The dump's members but the entries, as Python objects; the entries' list node. */
    int32_t entries = -1;
    const Node *rn = &c.nodes[root];
    top = PyDict_New();
    if (!top) goto out;
    for (int32_t r = rn->n ? (int32_t)rn->v : -1; r >= 0; r = c.refs[c.refs[r].next].next) {
        int32_t k = c.refs[r].node, v = c.refs[c.refs[r].next].node;
        if (str_is(&c, &c.nodes[k], "entries", 7)) {
            entries = v;
            continue;
        }
        PyObject *key = to_py(&c, k, 1), *value = key ? to_py(&c, v, 1) : NULL;
        int bad = !value || PyDict_SetItem(top, key, value) < 0;
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (bad) goto out;
    }
    if (entries < 0 || c.nodes[entries].type != T_LIST) goto out;
    size_t n = c.nodes[entries].n;
    if (table_bytes(&c) + n * (N_INT * 9 + N_CODED * 4) > c.max_bytes) goto out;
    ints = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * N_INT * 8));
    valid = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * N_INT));
    codes = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * N_CODED * 4));
    if (!ints || !valid || !codes) goto out;
    if (!columns(&c, entries, (int64_t *)PyBytes_AS_STRING(ints), PyBytes_AS_STRING(valid),
                 (int32_t *)PyBytes_AS_STRING(codes), tables))
        goto out;
    distinct = PyTuple_New(N_CODED);
    if (!distinct) goto out;
    for (int f = 0; f < N_CODED; f++) {
        PyObject *values = PyList_New((Py_ssize_t)tables[f].used);
        if (!values) goto out;
        PyTuple_SET_ITEM(distinct, f, values);
        for (size_t i = 0; i < tables[f].used; i++) {
            PyObject *o = to_py(&c, tables[f].first[i], 0);
            if (!o) goto out;
            PyList_SET_ITEM(values, (Py_ssize_t)i, o);
        }
    }
    result = Py_BuildValue("(OnOOOO)", top, (Py_ssize_t)n, ints, valid, codes, distinct);
out:
    Py_XDECREF(top);
    Py_XDECREF(ints);
    Py_XDECREF(valid);
    Py_XDECREF(codes);
    Py_XDECREF(distinct);
    ctx_free(&c, tables);
    PyBuffer_Release(&buf);
    if (!result) {
        PyErr_Clear();
        if (c.bad_memo) return PyLong_FromUnsignedLongLong(c.bad_memo);
        Py_RETURN_NONE;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(data, max_bytes) -> (top, n, ints, valid, codes, distinct), or None outside the plain subset"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_frdecode",
                                    "Flight Recorder pickles into columns (see _frdecode.c)", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__frdecode(void) { return PyModule_Create(&module); }
