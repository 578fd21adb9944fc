/*
 * shim/schema.h - the parsed form of an op schema, the one description of
 * an op's arguments on the C side.
 *
 * ng_def (shim.h) parses every schema it registers with ng_schema_parse and
 * keeps the result in a table keyed by the op's name ("safe_sdpa.masked");
 * ng_take_args finds it there, so a boxed kernel reads its arguments by
 * name and never restates their kinds or positions.
 *
 * The grammar is the subset of PyTorch's schema language nanguard uses:
 *
 *   schema  := name ['.' overload] '(' [arg {',' arg}] ')' '->' returns
 *   arg     := type [alias] ['[]'] name ['=' default]   |   '*'
 *   type    := 'Tensor' | 'int' | 'SymInt' | 'float' | 'bool'
 *   alias   := '(' letters ['!'] ')'                     (Tensor only)
 *   returns := '()' | ret | '(' ret {',' ret} ')'
 *   ret     := 'Tensor' [alias] [name]
 *
 * Anything else (an optional `Tensor?`, a `str`, a `Scalar`, a second
 * Tensor[] argument, more than NG_SCHEMA_MAX_ARGS arguments) is refused as
 * a value naming the first offending character; nothing here raises or
 * allocates, and this file knows nothing of PyTorch (tests/c/test_schema.c
 * compiles it alone).
 */
#ifndef NG_SCHEMA_H
#define NG_SCHEMA_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Most arguments of any nanguard schema (safe_sdpa_backward.masked has 13). */
#define NG_SCHEMA_MAX_ARGS 16
/* Longest op name ("name.overload") and argument name, with the NUL. */
#define NG_SCHEMA_NAME_LEN 64
#define NG_SCHEMA_ARG_LEN 32

typedef enum ng_arg_kind {
    NG_ARG_TENSOR,      /* Tensor: an owning handle on the stack */
    NG_ARG_TENSOR_LIST, /* Tensor[]: a list handle (at most one per schema) */
    NG_ARG_INT,         /* int, SymInt */
    NG_ARG_FLOAT,       /* float (a double on the stack) */
    NG_ARG_BOOL,
} ng_arg_kind;

typedef struct ng_schema_arg {
    char name[NG_SCHEMA_ARG_LEN];
    ng_arg_kind kind;
    bool written; /* an alias annotation with '!': the op writes it in place */
} ng_schema_arg;

typedef struct ng_schema {
    char name[NG_SCHEMA_NAME_LEN]; /* "safe_sdpa.masked"; no ".default" */
    int num_args;
    int num_returns; /* every return is a Tensor */
    ng_schema_arg args[NG_SCHEMA_MAX_ARGS];
} ng_schema;

typedef enum ng_schema_status {
    NG_SCHEMA_OK = 0,
    NG_SCHEMA_BAD_NAME,      /* the op name is missing or too long */
    NG_SCHEMA_SYNTAX,        /* an expected character or word is missing */
    NG_SCHEMA_UNKNOWN_TYPE,  /* a type outside the grammar above */
    NG_SCHEMA_BAD_ARG_NAME,  /* an argument without a name, or one too long */
    NG_SCHEMA_DUPLICATE_ARG, /* two arguments of one name */
    NG_SCHEMA_TOO_MANY_ARGS, /* more than NG_SCHEMA_MAX_ARGS */
    NG_SCHEMA_TWO_LISTS,     /* a second Tensor[] argument */
    NG_SCHEMA_BAD_RETURN,    /* a return other than Tensor */
    NG_SCHEMA_TRAILING,      /* text after the returns */
    NG_SCHEMA_TABLE_FULL,    /* ng_schema_add: no room left in the table */
    NG_SCHEMA_CONFLICT,      /* ng_schema_add: the name is there with other arguments */
} ng_schema_status;

/* A short English phrase for a status ("unknown argument type", ...). */
const char *ng_schema_status_str(ng_schema_status s);

/* Parse `text` into *out. On an error *out is unspecified and, when `at` is
 * not NULL, *at is the offset in `text` of the character that was refused. */
ng_schema_status ng_schema_parse(const char *text, ng_schema *out, size_t *at);

/* The process-wide table that ng_def fills and ng_take_args reads. Adding a
 * schema whose name is present with the same arguments is a no-op (each
 * library registers its schemas twice: once to fingerprint them, once for
 * real); the table is written while the library loads, read-only after. */
#define NG_SCHEMA_TABLE_SIZE 32
ng_schema_status ng_schema_add(const ng_schema *s);
/* The schema registered under `name`, or NULL. */
const ng_schema *ng_schema_find(const char *name);
/* The index of argument `name` in s, or -1. */
int ng_schema_arg_index(const ng_schema *s, const char *name);

#ifdef __cplusplus
}
#endif

#endif /* NG_SCHEMA_H */
