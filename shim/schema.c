/*
 * shim/schema.c - the schema parser and the table of parsed schemas
 * (shim/schema.h). A recursive-descent reader over one string: every
 * function takes the cursor, advances it past what it read, and returns
 * NG_SCHEMA_OK or the error, leaving the cursor on the refused character.
 */
#include "shim/schema.h"

#include <string.h>

typedef struct cursor {
    const char *s;
    size_t i;
} cursor;

static void skip_space(cursor *c) {
    while (c->s[c->i] == ' ' || c->s[c->i] == '\t' || c->s[c->i] == '\n') c->i++;
}

static bool is_word_char(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '_';
}

/* Skip spaces, then consume `ch` if it is next. */
static bool eat(cursor *c, char ch) {
    skip_space(c);
    if (c->s[c->i] != ch) return false;
    c->i++;
    return true;
}

/* Skip spaces, then the length of the word at the cursor (not consumed). */
static size_t word_len(cursor *c) {
    skip_space(c);
    size_t n = 0;
    while (is_word_char(c->s[c->i + n])) n++;
    return n;
}

/* Copy the next word into dst (cap bytes with the NUL); false when there is
 * none or it does not fit. */
static bool take_word(cursor *c, char *dst, size_t cap) {
    size_t n = word_len(c);
    if (n == 0 || n >= cap) return false;
    memcpy(dst, c->s + c->i, n);
    dst[n] = '\0';
    c->i += n;
    return true;
}

static bool word_is(const cursor *c, size_t n, const char *w) {
    return strlen(w) == n && strncmp(c->s + c->i, w, n) == 0;
}

/* An optional alias annotation after Tensor: "(a)" or "(a!)". */
static ng_schema_status alias(cursor *c, bool *written) {
    *written = false;
    if (!eat(c, '(')) return NG_SCHEMA_OK;
    size_t n = word_len(c);
    if (n == 0) return NG_SCHEMA_SYNTAX;
    c->i += n;
    *written = eat(c, '!');
    return eat(c, ')') ? NG_SCHEMA_OK : NG_SCHEMA_SYNTAX;
}

/* A default value: skipped up to the ',' or ')' that ends it at depth 0. */
static ng_schema_status default_value(cursor *c) {
    int depth = 0;
    skip_space(c);
    const size_t start = c->i;
    for (;; c->i++) {
        const char ch = c->s[c->i];
        if (ch == '\0') return NG_SCHEMA_SYNTAX;
        if (ch == '[' || ch == '(') depth++;
        if ((ch == ']' || ch == ')') && depth > 0) {
            depth--;
            continue;
        }
        if (depth == 0 && (ch == ',' || ch == ')')) break;
    }
    if (c->i == start) return NG_SCHEMA_SYNTAX;
    return NG_SCHEMA_OK;
}

static ng_schema_status argument(cursor *c, ng_schema *out, bool *has_list) {
    const size_t n = word_len(c);
    ng_schema_arg a;
    memset(&a, 0, sizeof a);
    if (word_is(c, n, "Tensor"))
        a.kind = NG_ARG_TENSOR;
    else if (word_is(c, n, "int") || word_is(c, n, "SymInt"))
        a.kind = NG_ARG_INT;
    else if (word_is(c, n, "float"))
        a.kind = NG_ARG_FLOAT;
    else if (word_is(c, n, "bool"))
        a.kind = NG_ARG_BOOL;
    else
        return NG_SCHEMA_UNKNOWN_TYPE;
    c->i += n;
    if (a.kind == NG_ARG_TENSOR) {
        ng_schema_status st = alias(c, &a.written);
        if (st != NG_SCHEMA_OK) return st;
    }
    if (c->s[c->i] == '?') return NG_SCHEMA_UNKNOWN_TYPE; /* optionals are overloads here */
    if (eat(c, '[')) {
        if (a.kind != NG_ARG_TENSOR || !eat(c, ']')) return NG_SCHEMA_UNKNOWN_TYPE;
        if (*has_list) return NG_SCHEMA_TWO_LISTS;
        *has_list = true;
        a.kind = NG_ARG_TENSOR_LIST;
    }
    skip_space(c);
    if (!take_word(c, a.name, sizeof a.name)) return NG_SCHEMA_BAD_ARG_NAME;
    if (ng_schema_arg_index(out, a.name) >= 0) {
        c->i -= strlen(a.name);
        return NG_SCHEMA_DUPLICATE_ARG;
    }
    if (eat(c, '=')) {
        ng_schema_status st = default_value(c);
        if (st != NG_SCHEMA_OK) return st;
    }
    if (out->num_args == NG_SCHEMA_MAX_ARGS) return NG_SCHEMA_TOO_MANY_ARGS;
    out->args[out->num_args++] = a;
    return NG_SCHEMA_OK;
}

static ng_schema_status arguments(cursor *c, ng_schema *out) {
    bool has_list = false;
    if (!eat(c, '(')) return NG_SCHEMA_SYNTAX;
    if (eat(c, ')')) return NG_SCHEMA_OK;
    for (;;) {
        if (eat(c, '*')) { /* the start of keyword-only arguments: not an argument */
            if (!eat(c, ',')) return NG_SCHEMA_SYNTAX;
        }
        ng_schema_status st = argument(c, out, &has_list);
        if (st != NG_SCHEMA_OK) return st;
        if (eat(c, ')')) return NG_SCHEMA_OK;
        if (!eat(c, ',')) return NG_SCHEMA_SYNTAX;
    }
}

/* One returned value: Tensor, an optional alias, an optional name. */
static ng_schema_status one_return(cursor *c, ng_schema *out) {
    const size_t n = word_len(c);
    if (!word_is(c, n, "Tensor")) return n ? NG_SCHEMA_BAD_RETURN : NG_SCHEMA_SYNTAX;
    c->i += n;
    bool written;
    ng_schema_status st = alias(c, &written);
    if (st != NG_SCHEMA_OK) return st;
    skip_space(c);
    if (c->s[c->i] == '[' || c->s[c->i] == '?') return NG_SCHEMA_BAD_RETURN;
    c->i += word_len(c); /* a name, if any */
    out->num_returns++;
    return NG_SCHEMA_OK;
}

static ng_schema_status returns(cursor *c, ng_schema *out) {
    skip_space(c);
    if (c->s[c->i] != '-' || c->s[c->i + 1] != '>') return NG_SCHEMA_SYNTAX;
    c->i += 2;
    if (!eat(c, '(')) return one_return(c, out);
    if (eat(c, ')')) return NG_SCHEMA_OK;
    for (;;) {
        ng_schema_status st = one_return(c, out);
        if (st != NG_SCHEMA_OK) return st;
        if (eat(c, ')')) return NG_SCHEMA_OK;
        if (!eat(c, ',')) return NG_SCHEMA_SYNTAX;
    }
}

/* name ['.' overload], copied into out->name. */
static ng_schema_status op_name(cursor *c, ng_schema *out) {
    size_t n = word_len(c);
    if (n == 0) return NG_SCHEMA_BAD_NAME;
    if (c->s[c->i + n] == '.') {
        const size_t base = n + 1;
        n = base;
        while (is_word_char(c->s[c->i + n])) n++;
        if (n == base) {
            c->i += n;
            return NG_SCHEMA_BAD_NAME;
        }
    }
    if (n >= sizeof out->name) return NG_SCHEMA_BAD_NAME;
    memcpy(out->name, c->s + c->i, n);
    out->name[n] = '\0';
    c->i += n;
    return NG_SCHEMA_OK;
}

ng_schema_status ng_schema_parse(const char *text, ng_schema *out, size_t *at) {
    cursor c = {text ? text : "", 0};
    memset(out, 0, sizeof *out);
    ng_schema_status st = op_name(&c, out);
    if (st == NG_SCHEMA_OK) st = arguments(&c, out);
    if (st == NG_SCHEMA_OK) st = returns(&c, out);
    if (st == NG_SCHEMA_OK) {
        skip_space(&c);
        if (c.s[c.i] != '\0') st = NG_SCHEMA_TRAILING;
    }
    if (at) *at = c.i;
    return st;
}

const char *ng_schema_status_str(ng_schema_status s) {
    switch (s) {
    case NG_SCHEMA_OK: return "ok";
    case NG_SCHEMA_BAD_NAME: return "missing or over-long op name";
    case NG_SCHEMA_SYNTAX: return "syntax error";
    case NG_SCHEMA_UNKNOWN_TYPE:
        return "unsupported argument type (Tensor, Tensor[], int, SymInt, float, bool)";
    case NG_SCHEMA_BAD_ARG_NAME: return "missing or over-long argument name";
    case NG_SCHEMA_DUPLICATE_ARG: return "two arguments of one name";
    case NG_SCHEMA_TOO_MANY_ARGS: return "too many arguments";
    case NG_SCHEMA_TWO_LISTS: return "more than one Tensor[] argument";
    case NG_SCHEMA_BAD_RETURN: return "a return other than Tensor";
    case NG_SCHEMA_TRAILING: return "text after the returns";
    case NG_SCHEMA_TABLE_FULL: return "the schema table is full";
    case NG_SCHEMA_CONFLICT: return "the op name is registered with other arguments";
    }
    return "unknown schema status";
}

int ng_schema_arg_index(const ng_schema *s, const char *name) {
    for (int i = 0; i < s->num_args; i++)
        if (strcmp(s->args[i].name, name) == 0) return i;
    return -1;
}

/* ---- the table ----------------------------------------------------------------- */

static ng_schema ng_schema_table[NG_SCHEMA_TABLE_SIZE];
static int ng_schema_count;

const ng_schema *ng_schema_find(const char *name) {
    for (int i = 0; i < ng_schema_count; i++)
        if (strcmp(ng_schema_table[i].name, name) == 0) return &ng_schema_table[i];
    return NULL;
}

static bool same_schema(const ng_schema *a, const ng_schema *b) {
    if (a->num_args != b->num_args || a->num_returns != b->num_returns) return false;
    for (int i = 0; i < a->num_args; i++)
        if (strcmp(a->args[i].name, b->args[i].name) != 0 || a->args[i].kind != b->args[i].kind ||
            a->args[i].written != b->args[i].written)
            return false;
    return true;
}

ng_schema_status ng_schema_add(const ng_schema *s) {
    const ng_schema *have = ng_schema_find(s->name);
    if (have) return same_schema(have, s) ? NG_SCHEMA_OK : NG_SCHEMA_CONFLICT;
    if (ng_schema_count == NG_SCHEMA_TABLE_SIZE) return NG_SCHEMA_TABLE_FULL;
    ng_schema_table[ng_schema_count++] = *s;
    return NG_SCHEMA_OK;
}
