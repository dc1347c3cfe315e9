package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/openai"
	"github.com/sluicegw/sluice/internal/budget"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// estimateOf is the admission estimate of body as estimate() computes it
// for output cap maxOut per sequence.
func estimateOf(t *testing.T, body string, maxOut int64) int64 {
	r, e := openai.ParseRequest([]byte(body))
	require.Nil(t, e)
	return (r.PromptEstimate()*4+2)/3 + 16 + r.OutputChoices()*maxOut
}

// TestLimitsEstimateCountsChoices (real Redis): n, best_of and batch
// prompts multiply the tpm estimate and the budget reservation, and
// settlement replaces the reservation by the real cost.
func TestLimitsEstimateCountsChoices(t *testing.T) {
	le := newLimitsEnv(t)
	up := &slowUpstream{n: 60, interval: 5 * time.Millisecond}
	le.group("m")
	le.deploy("d1", "m", startUpstream(t, up), nil) // $1e-6 in, $2e-6 out per token
	const tpm = 1_000_000
	smallTPM := le.key("k-small", func(k *configv1.Key) { k.Limits = &configv1.Limits{TpmLimit: ptr[int64](2000)} })
	budgetKey := le.key("k-bud", func(k *configv1.Key) {
		k.Limits = &configv1.Limits{MaxBudget: ptr(10.0), BudgetDuration: "1d"}
	})
	le.apply()

	// The estimate is in x-ratelimit-remaining-tokens: each request gets a
	// fresh key's full window, so remaining = tpm − estimate.
	for i, tc := range []struct {
		route, body string
		maxOut      int64
	}{
		{RouteChat, chatBody("m", ""), 12},
		{RouteChat, chatBody("m", `"n":7`), 12},
		{RouteChat, chatBody("m", `"n":2,"best_of":9`), 12},
		{RouteCompletions, `{"model":"m","prompt":["one","two","three"],"n":4,"max_tokens":10}`, 10},
	} {
		tok := le.key(fmt.Sprintf("k-est%d", i), func(k *configv1.Key) { k.Limits = &configv1.Limits{TpmLimit: ptr[int64](tpm)} })
		le.apply()
		resp := le.post(tc.route, tok, tc.body)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, tc.body)
		rem, err := strconv.ParseInt(resp.Header.Get("X-Ratelimit-Remaining-Tokens"), 10, 64)
		require.NoError(t, err)
		require.Equal(t, tpm-estimateOf(t, tc.body, tc.maxOut), rem, "estimate of %s", tc.body)
	}

	// The request: n=50 × max_tokens=200 is 10,000 output tokens,
	// more than a tpm of 2,000 ever admits; nothing reaches the upstream.
	peak := up.peak.Load()
	big := `{"model":"m","messages":[{"role":"user","content":"hi"}],"n":50,"max_tokens":200}`
	e := readErr(t, le.post(RouteChat, smallTPM, big))
	require.Equal(t, http.StatusTooManyRequests, e.Status)
	require.Equal(t, openai.CodeTokenRateLimitExceeded, e.Error.Code)
	require.Equal(t, "false", e.Header.Get("X-Should-Retry"))
	require.Contains(t, e.Error.Message, fmt.Sprintf("estimated at %d tokens", estimateOf(t, big, 200)))
	require.Contains(t, e.Error.Message, "lower max_tokens, n or the prompt")
	require.Equal(t, peak, up.peak.Load())

	// The budget reservation of a stream in flight counts its 7 choices;
	// settlement replaces it with the real cost (10 prompt + 60 completion
	// tokens, as the upstream reports).
	body := chatBody("m", `"n":7,"stream":true`)
	pr, pe := openai.ParseRequest([]byte(body))
	require.Nil(t, pe)
	prompt := (pr.PromptEstimate()*4+2)/3 + 16
	wantReserve := budget.Micros(float64(prompt)*1e-6 + float64(7*12)*2e-6)
	resp := le.post(RouteChat, budgetKey, body)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	spendKey := le.prefix + "{o:o1}:lim:key:k-bud"
	waitFor(t, "the reservation", func() bool {
		v, err := le.rdb.HGet(context.Background(), spendKey, "bs").Int64()
		return err == nil && v == wantReserve
	})
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	le.drained()
	got, err := le.rdb.HGet(context.Background(), spendKey, "bs").Int64()
	require.NoError(t, err)
	require.Equal(t, budget.Micros(10*1e-6+60*2e-6), got, "settled at the real cost")
}

// TestEstimateOverflowIs400 (real Redis): output caps, token estimates and
// maximum costs that do not fit are 400s naming the parameter, never a 500,
// on keys with limits and without.
func TestEstimateOverflowIs400(t *testing.T) {
	le := newLimitsEnv(t)
	le.group("m")
	le.group("pricey")
	le.deploy("d1", "m", startUpstream(t, &slowUpstream{}), nil)
	le.deploy("d2", "pricey", startUpstream(t, &slowUpstream{}), func(d *configv1.Deployment) {
		d.Prices = &configv1.Prices{InputPerToken: 1, OutputPerToken: 1e6}
	})
	limited := le.key("k-lim", func(k *configv1.Key) {
		k.Limits = &configv1.Limits{TpmLimit: ptr[int64](1 << 40), MaxBudget: ptr(1e12), BudgetDuration: "1d"}
	})
	free := le.key("k-free", nil)
	le.apply()
	const msgs = `"messages":[{"role":"user","content":"hi"}]`
	for _, tc := range []struct {
		name, body  string
		code, param string
		onlyLimited bool
	}{
		{"max_tokens 2^63-1", `{"model":"m",` + msgs + `,"max_tokens":9223372036854775807}`, openai.CodeInvalidParameter, "max_tokens", false},
		{"max_completion_tokens 2^63-1", `{"model":"m",` + msgs + `,"max_completion_tokens":9223372036854775807}`, openai.CodeInvalidParameter, "max_completion_tokens", false},
		{"n × max_tokens", `{"model":"m",` + msgs + `,"n":1000000,"max_tokens":10000000}`, openai.CodeEstimateTooLarge, "n", false},
		{"n × max_tokens wraps int64", `{"model":"m",` + msgs + `,"n":4294967296,"max_tokens":4294967296}`, openai.CodeEstimateTooLarge, "n", false},
		{"n × the default output cap", `{"model":"m",` + msgs + `,"n":1000000000}`, openai.CodeEstimateTooLarge, "n", true},
		{"price × tokens", `{"model":"pricey",` + msgs + `,"max_tokens":10000}`, openai.CodeEstimateTooLarge, "max_tokens", true},
		{"price × tokens × n", `{"model":"pricey",` + msgs + `,"max_tokens":100,"n":100}`, openai.CodeEstimateTooLarge, "n", true},
		{"n not an integer", `{"model":"m",` + msgs + `,"n":1.5}`, openai.CodeInvalidParameter, "n", false},
		{"best_of not positive", `{"model":"m",` + msgs + `,"best_of":0}`, openai.CodeInvalidParameter, "best_of", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			keys := []string{limited}
			if !tc.onlyLimited {
				keys = append(keys, free)
			}
			for _, tok := range keys {
				a := readErr(t, le.post(RouteChat, tok, tc.body))
				require.Equal(t, http.StatusBadRequest, a.Status, "%+v", a.Error)
				require.Equal(t, openai.TypeInvalidRequest, a.Error.Type)
				require.Equal(t, tc.code, a.Error.Code, a.Error.Message)
				require.Equal(t, tc.param, deref(a.Error.Param))
				require.Equal(t, "false", a.Header.Get("X-Should-Retry"))
				require.False(t, strings.Contains(a.Error.Message, "internal"), a.Error.Message)
				ev := le.sink.byID(t, a.Header.Get(openai.RequestIDHeader))
				require.Equal(t, int32(http.StatusBadRequest), ev.Status)
				require.Equal(t, tc.code, ev.ErrorCode)
			}
		})
	}
	// A request at the bounds' edge is still served.
	resp := le.post(RouteChat, limited, `{"model":"m",`+msgs+`,"n":2,"max_tokens":40}`)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	le.drained()
}
