/* tests/c/test_schema.c - the schema parser of shim/schema.c: every schema
 * nanguard registers (ops/ops.h) reads back with the argument kinds, names
 * and return counts its kernels rely on; malformed schemas come back as the
 * matching error value with the offset of the refused character; the table
 * that ng_def fills and ng_take_args reads. No PyTorch involved. */
#include <string.h>

#include "ops/ops.h"
#include "shim/schema.c" /* the unit under test, compiled in */
#include "tests/c/ng_test.h"

static const char *const all_schemas[] = {
#define AS_STRING(s) s,
    NG_ALL_SCHEMAS(AS_STRING)
#undef AS_STRING
};

static const ng_schema *parse_ok(const char *text, ng_schema *out) {
    size_t at = 0;
    ng_schema_status st = ng_schema_parse(text, out, &at);
    if (st != NG_SCHEMA_OK)
        fprintf(stderr, "  \"%s\": %s at %zu\n", text, ng_schema_status_str(st), at);
    NG_EXPECT(st == NG_SCHEMA_OK);
    return out;
}

static void expect_arg(const ng_schema *s, int i, const char *name, ng_arg_kind kind,
                       bool written) {
    NG_EXPECT(i < s->num_args);
    if (i >= s->num_args) return;
    NG_EXPECT(strcmp(s->args[i].name, name) == 0);
    NG_EXPECT(s->args[i].kind == kind);
    NG_EXPECT(s->args[i].written == written);
    NG_EXPECT(ng_schema_arg_index(s, name) == i);
}

/* `text` is refused with `want`, at character `at` (or anywhere when at < 0). */
static void expect_error(const char *text, ng_schema_status want, long at) {
    ng_schema s;
    size_t got_at = 0;
    ng_schema_status got = ng_schema_parse(text, &s, &got_at);
    if (got != want || (at >= 0 && got_at != (size_t)at))
        fprintf(stderr, "  \"%s\": got \"%s\" at %zu, want \"%s\" at %ld\n", text ? text : "(null)",
                ng_schema_status_str(got), got_at, ng_schema_status_str(want), at);
    NG_EXPECT(got == want);
    NG_EXPECT(at < 0 || got_at == (size_t)at);
    NG_EXPECT(strlen(ng_schema_status_str(got)) > 0);
}

static void test_registered(void) {
    const size_t n = sizeof all_schemas / sizeof all_schemas[0];
    NG_EXPECT(n == 14);
    for (size_t i = 0; i < n; i++) {
        ng_schema s;
        parse_ok(all_schemas[i], &s);
        NG_EXPECT(s.num_args > 0 && s.num_args <= NG_SCHEMA_MAX_ARGS);
        NG_EXPECT(s.num_returns <= 3);
        NG_EXPECT(ng_schema_add(&s) == NG_SCHEMA_OK);
        NG_EXPECT(ng_schema_add(&s) == NG_SCHEMA_OK); /* the second registration pass */
        NG_EXPECT(ng_schema_find(s.name) != NULL);
    }
    /* the argument lists the kernels read, by name and kind */
    const ng_schema *s = ng_schema_find("safe_sdpa_backward.masked");
    NG_EXPECT(s && s->num_args == 13 && s->num_returns == 3);
    if (s) {
        const char *t[] = {"grad_out", "query", "key", "value", "attn_mask", "out", "lse"};
        for (int i = 0; i < 7; i++) expect_arg(s, i, t[i], NG_ARG_TENSOR, false);
        expect_arg(s, 7, "dropout_p", NG_ARG_FLOAT, false);
        expect_arg(s, 8, "is_causal", NG_ARG_BOOL, false);
        expect_arg(s, 11, "softcap", NG_ARG_FLOAT, false);
        expect_arg(s, 12, "rng", NG_ARG_TENSOR, false);
    }
    s = ng_schema_find("safe_sdpa");
    NG_EXPECT(s && s->num_args == 9 && s->num_returns == 2 &&
              ng_schema_arg_index(s, "attn_mask") < 0);
    s = ng_schema_find("stable_layernorm.weight_bias");
    NG_EXPECT(s && s->num_args == 5 && s->num_returns == 3);
    if (s) {
        expect_arg(s, 2, "bias", NG_ARG_TENSOR, false);
        expect_arg(s, 3, "eps", NG_ARG_FLOAT, false);
        expect_arg(s, 4, "rms", NG_ARG_BOOL, false);
    }
    s = ng_schema_find("stable_layernorm_backward");
    NG_EXPECT(s && s->num_returns == 2 && ng_schema_arg_index(s, "weight") < 0);
    s = ng_schema_find("grad_guard_apply_");
    NG_EXPECT(s && s->num_args == 6 && s->num_returns == 1);
    if (s) {
        expect_arg(s, 0, "grads", NG_ARG_TENSOR_LIST, true);
        expect_arg(s, 1, "inv_scale", NG_ARG_TENSOR, false);
        expect_arg(s, 3, "found_inf", NG_ARG_TENSOR, true);
        expect_arg(s, 5, "norm_type", NG_ARG_FLOAT, false);
    }
    s = ng_schema_find("grad_guard_reduce");
    NG_EXPECT(s && s->num_returns == 1);
    if (s) expect_arg(s, 0, "grads", NG_ARG_TENSOR_LIST, false);
    s = ng_schema_find("tensor_stats_");
    NG_EXPECT(s && s->num_args == 4 && s->num_returns == 0);
    if (s) expect_arg(s, 3, "slot", NG_ARG_INT, false);
    NG_EXPECT(ng_schema_find("safe_sdpa.default") == NULL);
    NG_EXPECT(ng_schema_find("nope") == NULL);
}

static void test_grammar(void) {
    ng_schema s;
    parse_ok("f() -> ()", &s);
    NG_EXPECT(strcmp(s.name, "f") == 0 && s.num_args == 0 && s.num_returns == 0);
    parse_ok("  g.over ( Tensor  x ,SymInt n, *, float y=1.5, bool b=False, int k=[1, (2)] )"
             "->(Tensor(a!) out, Tensor)  ",
             &s);
    NG_EXPECT(strcmp(s.name, "g.over") == 0 && s.num_args == 5 && s.num_returns == 2);
    expect_arg(&s, 1, "n", NG_ARG_INT, false);
    expect_arg(&s, 3, "b", NG_ARG_BOOL, false);
    expect_arg(&s, 4, "k", NG_ARG_INT, false);
    parse_ok("h(Tensor(a!)[] xs) -> Tensor", &s);
    expect_arg(&s, 0, "xs", NG_ARG_TENSOR_LIST, true);
    NG_EXPECT(s.num_returns == 1);
}

static void test_malformed(void) {
    expect_error(NULL, NG_SCHEMA_BAD_NAME, 0);
    expect_error("", NG_SCHEMA_BAD_NAME, 0);
    expect_error("(Tensor x) -> Tensor", NG_SCHEMA_BAD_NAME, 0);
    expect_error("f.(Tensor x) -> Tensor", NG_SCHEMA_BAD_NAME, 2);
    expect_error("f Tensor x) -> Tensor", NG_SCHEMA_SYNTAX, 2);
    expect_error("f(Tensor x -> Tensor", NG_SCHEMA_SYNTAX, 11);
    expect_error("f(Tensor x)", NG_SCHEMA_SYNTAX, 11);
    expect_error("f(Tensor x) => Tensor", NG_SCHEMA_SYNTAX, 12);
    expect_error("f(Tensor x,) -> Tensor", NG_SCHEMA_UNKNOWN_TYPE, 11);
    expect_error("f(Tensor x, str s) -> Tensor", NG_SCHEMA_UNKNOWN_TYPE, 12);
    expect_error("f(Tensor? x) -> Tensor", NG_SCHEMA_UNKNOWN_TYPE, 8);
    expect_error("f(Scalar x) -> Tensor", NG_SCHEMA_UNKNOWN_TYPE, 2);
    expect_error("f(int[] x) -> Tensor", NG_SCHEMA_UNKNOWN_TYPE, -1);
    expect_error("f(tensor x) -> Tensor", NG_SCHEMA_UNKNOWN_TYPE, 2);
    expect_error("f(Tensor(a! x) -> Tensor", NG_SCHEMA_SYNTAX, -1);
    expect_error("f(Tensor) -> Tensor", NG_SCHEMA_BAD_ARG_NAME, 8);
    expect_error("f(Tensor x, float x) -> Tensor", NG_SCHEMA_DUPLICATE_ARG, 18);
    expect_error("f(Tensor[] a, Tensor[] b) -> Tensor", NG_SCHEMA_TWO_LISTS, -1);
    expect_error("f(float x=) -> Tensor", NG_SCHEMA_SYNTAX, -1);
    expect_error("f(Tensor x) -> int", NG_SCHEMA_BAD_RETURN, -1);
    expect_error("f(Tensor x) -> (Tensor, float)", NG_SCHEMA_BAD_RETURN, -1);
    expect_error("f(Tensor x) -> Tensor[]", NG_SCHEMA_BAD_RETURN, -1);
    expect_error("f(Tensor x) -> (Tensor", NG_SCHEMA_SYNTAX, -1);
    expect_error("f(Tensor x) -> Tensor y z", NG_SCHEMA_TRAILING, 24);
    expect_error("f(Tensor x) -> ", NG_SCHEMA_SYNTAX, -1);
    expect_error("f(Tensor a0, Tensor a1, Tensor a2, Tensor a3, Tensor a4, Tensor a5, Tensor a6, "
                 "Tensor a7, Tensor a8, Tensor a9, Tensor a10, Tensor a11, Tensor a12, "
                 "Tensor a13, Tensor a14, Tensor a15, Tensor a16) -> ()",
                 NG_SCHEMA_TOO_MANY_ARGS, -1);
    expect_error("a_name_of_sixty_four_characters_is_one_more_than_the_table_holds(Tensor x) -> ()",
                 NG_SCHEMA_BAD_NAME, 0);
    expect_error("f(Tensor an_argument_name_of_32_characters_x) -> ()", NG_SCHEMA_BAD_ARG_NAME, -1);
}

static void test_table(void) {
    ng_schema s;
    /* a name already registered with other arguments is refused */
    parse_ok("safe_sdpa(Tensor query) -> Tensor", &s);
    NG_EXPECT(ng_schema_add(&s) == NG_SCHEMA_CONFLICT);
    NG_EXPECT(ng_schema_find("safe_sdpa")->num_args == 9);
    /* fill the table: the first name past its size is refused, as a value */
    char text[64];
    ng_schema_status st = NG_SCHEMA_OK;
    int added = 0;
    for (int i = 0; i <= NG_SCHEMA_TABLE_SIZE && st == NG_SCHEMA_OK; i++) {
        snprintf(text, sizeof text, "filler%d(Tensor x) -> ()", i);
        parse_ok(text, &s);
        st = ng_schema_add(&s);
        added += st == NG_SCHEMA_OK;
    }
    NG_EXPECT(st == NG_SCHEMA_TABLE_FULL);
    NG_EXPECT(added == NG_SCHEMA_TABLE_SIZE - 14);
}

int main(void) {
    test_registered();
    test_grammar();
    test_malformed();
    test_table();
    return ng_test_finish("test_schema");
}
