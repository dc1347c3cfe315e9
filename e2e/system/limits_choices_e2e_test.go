package system

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluicegw/sluice/e2e/harness"

	"github.com/sluicegw/sluice/dataplane"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestLimitsNChoicesWithinBudgetAndTPM is issue 19's n must-show, through
// the whole system: the admin API sets the limits, a real data plane
// admits in the machine's Redis, the vLLM simulator generates n choices
// (ignore_eos: every choice runs to max_tokens, the worst case), and the
// ledger (spend_logs) records what was charged.
//
//   - The issue's key: max_budget $0.01/day and tpm 2,000; 10 parallel
//     requests with n=50, max_tokens=200 (10,000 output tokens each, before
//     the fix 8 were admitted: $0.16 and 80,000 tokens). Now none fits the
//     tpm: spend and tokens stay 0.
//   - The same limits with n=4 (832 estimated tokens each): tpm admits two,
//     streams and non-streams; real tokens ≤ 2,000 and each admitted
//     request is charged its 4 × 200 completion tokens.
//   - A $0.01/day budget alone with n=50, max_tokens=200: the first request
//     reserves its whole maximum cost ($0.020032 > the cap), so exactly one
//     is admitted and the spend stays below cap + one request's maximum
//     cost (docs/limits.md).
func TestLimitsNChoicesWithinBudgetAndTPM(t *testing.T) {
	const (
		capUSD  = 0.01
		tpm     = 2000
		maxOut  = 200
		inPrice = 1e-6
		outPr   = 2e-6
		clients = 10
	)
	msgs := `[{"role":"user","content":"Count to a few hundred."}]`
	// The proxy's prompt estimate (estimate() in internal/proxy/limits.go):
	// ⌈4/3 × bytes/4⌉ + 16.
	promptEst := int64((len(msgs)/4*4+2)/3 + 16)
	reserve := func(n int64) (tokens int64, usd float64) {
		tokens = promptEst + n*maxOut
		micros := math.Ceil((float64(promptEst)*inPrice + float64(n*maxOut)*outPr) * 1e6)
		return tokens, micros / 1e6
	}

	d := startDist(t)
	cfg := vllmsim.DefaultConfig()
	cfg.Addr, cfg.TimeScale, cfg.IgnoreEOS = "127.0.0.1:0", 50, true
	sim := harness.StartSim(t, cfg)
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "qwen", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "qwen",
		ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
		Prices: &adminv1.Prices{InputPerToken: inPrice, OutputPerToken: outPr}}))
	require.NoError(t, err)
	ten := d.NewTenant("nchoices")
	both := &adminv1.Limits{MaxBudget: proto.Float64(capUSD), BudgetDuration: "1d", TpmLimit: proto.Int64(tpm)}
	issueKey, issueTok := lloadKey(t, d, ten, both)
	smallKey, smallTok := lloadKey(t, d, ten, both)
	budgetKey, budgetTok := lloadKey(t, d, ten, &adminv1.Limits{MaxBudget: proto.Float64(capUSD), BudgetDuration: "1d"})
	p := lloadProxies(t, d, 1)[0]
	c := lloadClient(t)
	windowStart := time.Now().UTC()

	type answer struct {
		lloadAnswer
		stream           bool
		choices          int // distinct choice indexes the client received
		completionTokens int64
	}
	// burst sends clients requests at once; odd ones stream (with usage).
	burst := func(tok string, n int, streams bool) []answer {
		out := make([]answer, clients)
		var wg sync.WaitGroup
		for i := range clients {
			stream := streams && i%2 == 1
			wg.Go(func() {
				body := fmt.Sprintf(`{"model":"qwen","messages":%s,"n":%d,"max_tokens":%d}`, msgs, n, maxOut)
				if stream {
					body = strings.TrimSuffix(body, "}") + `,"stream":true,"stream_options":{"include_usage":true}}`
				}
				a := answer{lloadAnswer: lloadPost(ctx, c, p.URL, tok, body), stream: stream}
				if a.status == http.StatusOK {
					a.choices, a.completionTokens = readChoices(t, a.body, stream)
				}
				out[i] = a
			})
		}
		wg.Wait()
		return out
	}
	tally := func(as []answer) (ok int, codes map[string]int) {
		codes = map[string]int{}
		for _, a := range as {
			require.NoError(t, a.err)
			if a.status == http.StatusOK {
				ok++
				continue
			}
			codes[fmt.Sprintf("%d %s", a.status, a.code())]++
		}
		return ok, codes
	}

	// 1. The issue's requests on the issue's key.
	issue := burst(issueTok, 50, true)
	ok, codes := tally(issue)
	require.Zero(t, ok, "n=50 × max_tokens=200 admitted under a tpm of 2,000: %v", codes)
	never := fmt.Sprintf("%d %s", http.StatusTooManyRequests, dataplane.CodeTokenRateLimitExceeded)
	require.Equal(t, map[string]int{never: clients}, codes)
	for _, a := range issue {
		require.Equal(t, "false", a.hdr.Get("X-Should-Retry"), "the estimate alone exceeds the tpm: retrying cannot help")
		est, _ := reserve(50)
		require.Contains(t, string(a.body), fmt.Sprintf("estimated at %d tokens", est))
	}

	// 2. n=4: the tpm admits what fits.
	est4, res4 := reserve(4)
	require.LessOrEqual(t, 2*est4, int64(tpm))
	require.Greater(t, 3*est4, int64(tpm))
	small := burst(smallTok, 4, true)
	ok, codes = tally(small)
	t.Logf("n=4: %d admitted, refusals %v", ok, codes)
	require.LessOrEqual(t, ok, 2, "the tpm admits two estimates of %d tokens", est4)
	for code := range codes {
		require.Contains(t, []string{never, "503 " + dataplane.CodeLimitsUnavailable}, code)
	}
	for _, a := range small {
		if a.status == http.StatusOK {
			require.Equal(t, 4, a.choices, "the simulator generates n choices (stream %v)", a.stream)
			require.EqualValues(t, 4*maxOut, a.completionTokens, "usage counts every choice (stream %v)", a.stream)
		}
	}

	// 3. The budget alone, n=50: one request's reservation exceeds the cap.
	_, res50 := reserve(50)
	require.Greater(t, res50, capUSD)
	bud := burst(budgetTok, 50, false)
	ok, codes = tally(bud)
	t.Logf("budget, n=50: %d admitted, refusals %v", ok, codes)
	require.LessOrEqual(t, ok, 1, "a reservation above the cap leaves room for no second request")
	for code := range codes {
		require.Contains(t, []string{fmt.Sprintf("%d %s", http.StatusTooManyRequests, dataplane.CodeBudgetExceeded),
			"503 " + dataplane.CodeLimitsUnavailable}, code)
	}
	lloadDrain(t, []*proxy{p})

	// The ledger: one row per request; admitted rows carry the engine's
	// usage of all their choices.
	type row struct {
		key                string
		status             int32
		prompt, completion int64
		cost               float64
	}
	total := len(issue) + len(small) + len(bud)
	rows := map[string]row{}
	if !harness.Until(func() bool {
		rows = map[string]row{}
		d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
			rs, err := conn.Query(ctx, `SELECT request_id, key_id, status, prompt_tokens, completion_tokens, cost_usd FROM spend_logs WHERE org_id = $1`, ten.OrgID)
			require.NoError(t, err)
			for rs.Next() {
				var id string
				var r row
				require.NoError(t, rs.Scan(&id, &r.key, &r.status, &r.prompt, &r.completion, &r.cost))
				rows[id] = r
			}
			require.NoError(t, rs.Err())
		})
		return len(rows) >= total
	}, 60*time.Second, 50*time.Millisecond) {
		t.Fatalf("spend_logs has %d of %d requests; spend consumer: %s", len(rows), total, d.spendConsumerInfo())
	}
	spend := map[string]float64{}
	tokens := map[string]int64{}
	for _, as := range [][]answer{issue, small, bud} {
		for _, a := range as {
			r, found := rows[a.id]
			require.True(t, found, "no spend_logs row for %s", a.id)
			require.Equal(t, int32(a.status), r.status)
			if a.status != http.StatusOK {
				require.Zero(t, r.cost+float64(r.prompt+r.completion), "refused request %s charged", a.id)
				continue
			}
			require.EqualValues(t, a.completionTokens, r.completion, "ledger = the engine's usage")
			require.InDelta(t, float64(r.prompt)*inPrice+float64(r.completion)*outPr, r.cost, 1e-12)
			require.LessOrEqual(t, r.prompt, promptEst, "real prompt within the estimate (the bounds' premise)")
			spend[r.key] += r.cost
			tokens[r.key] += r.prompt + r.completion
		}
	}
	rdb := redis.NewClient(&redis.Options{Addr: testRedisAddr})
	defer rdb.Close()
	counter := func(key string) float64 {
		v, err := rdb.HGet(ctx, d.RedisPrefix+"{o:"+ten.OrgID+"}:lim:key:"+key, "bs").Int64()
		if errors.Is(err, redis.Nil) {
			return 0
		}
		require.NoError(t, err)
		return float64(v) / 1e6
	}
	t.Logf("issue key: spend $%.6f, %d tokens (cap $%.2f, tpm %d); n=4 key: spend $%.6f, %d tokens (reservation $%.6f, estimate %d); "+
		"budget key: spend $%.6f (bound cap + one reservation $%.6f); Redis counters $%.6f / $%.6f / $%.6f",
		spend[issueKey], tokens[issueKey], capUSD, tpm, spend[smallKey], tokens[smallKey], res4, est4,
		spend[budgetKey], capUSD+res50, counter(issueKey), counter(smallKey), counter(budgetKey))
	require.Zero(t, spend[issueKey])
	require.Zero(t, tokens[issueKey])
	require.LessOrEqual(t, tokens[smallKey], int64(tpm), "real tokens within the tpm (one 60 s window)")
	if end := windowStart.Truncate(24 * time.Hour).Add(24 * time.Hour); time.Now().After(end) {
		t.Logf("the 1d budget window ended during the test (%s): the cap applies per window", end)
		return
	}
	require.LessOrEqual(t, spend[smallKey], capUSD+res4)
	require.LessOrEqual(t, spend[budgetKey], capUSD+res50, "spend over the cap beyond the in-flight bound")
	for _, k := range []string{issueKey, smallKey, budgetKey} {
		require.InDelta(t, spend[k], counter(k), 1e-5, "Redis budget counter = ledger (µUSD rounding) for %s", k)
	}
}

// readChoices reads a chat answer (JSON or SSE) and returns the number of
// distinct choice indexes and the usage's completion tokens.
func readChoices(t *testing.T, body []byte, stream bool) (choices int, completion int64) {
	t.Helper()
	type usage struct {
		CompletionTokens int64 `json:"completion_tokens"`
	}
	type doc struct {
		Choices []struct {
			Index int `json:"index"`
		} `json:"choices"`
		Usage *usage `json:"usage"`
	}
	seen := map[int]bool{}
	var docs []doc
	if stream {
		sc := bufio.NewScanner(strings.NewReader(string(body)))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		done := false
		for sc.Scan() {
			v, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			if v == "[DONE]" {
				done = true
				continue
			}
			var dc doc
			require.NoError(t, json.Unmarshal([]byte(v), &dc), v)
			docs = append(docs, dc)
		}
		require.True(t, done, "stream without [DONE]")
	} else {
		var dc doc
		require.NoError(t, json.Unmarshal(body, &dc), "%s", body)
		docs = append(docs, dc)
	}
	for _, dc := range docs {
		for _, c := range dc.Choices {
			seen[c.Index] = true
		}
		if dc.Usage != nil {
			completion = dc.Usage.CompletionTokens
		}
	}
	return len(seen), completion
}

// TestUpstreamRefusalsTypedEndToEnd: through the admin API, a data plane
// and a vLLM simulator that requires an API key: a deployment whose
// (sealed) credential the engine refuses answers 502 upstream_auth_failed,
// never the engine's 401; a body the engine refuses (messages [1,2])
// answers 400 upstream_bad_request with the engine's message; a
// max_tokens of 2^63−1 on a key with limits is a 400 naming it, never a
// 500. The ledger records the engine's refusals with their codes.
func TestUpstreamRefusalsTypedEndToEnd(t *testing.T) {
	const simKey = "e2e-sim-api-key-0123456789"
	d := startDist(t)
	cfg := vllmsim.DefaultConfig()
	cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens, cfg.APIKey = "127.0.0.1:0", 20, 8, simKey
	sim := harness.StartSim(t, cfg)
	ctx := context.Background()
	m := d.modelClient()
	for g, cred := range map[string]string{"good": simKey, "badcred": "e2e-wrong-credential-9876"} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true}))
		require.NoError(t, err)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: g,
			ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, Credential: cred,
			Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6}}))
		require.NoError(t, err)
	}
	ten := d.NewTenant("refusals")
	_, tok := lloadKey(t, d, ten, &adminv1.Limits{TpmLimit: proto.Int64(100_000), MaxBudget: proto.Float64(5), BudgetDuration: "1d"})
	p := lloadProxies(t, d, 1)[0]
	c := lloadClient(t)

	ok := lloadPost(ctx, c, p.URL, tok, `{"model":"good","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)
	require.Equal(t, http.StatusOK, ok.status, "%s", ok.body)
	answers := []lloadAnswer{ok}
	for _, tc := range []struct {
		body, code, param, msg string
		status                 int
	}{
		{`{"model":"badcred","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`, dataplane.CodeUpstreamAuthFailed, "", "your API key is not the problem", http.StatusBadGateway},
		{`{"model":"badcred","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true}`, dataplane.CodeUpstreamAuthFailed, "", "HTTP 401", http.StatusBadGateway},
		{`{"model":"good","messages":[1,2],"max_tokens":4}`, dataplane.CodeUpstreamBadRequest, "", "the model server rejected the request: invalid JSON body", http.StatusBadRequest},
		{`{"model":"good","messages":[{"role":"user","content":"hi"}],"max_tokens":9223372036854775807}`, dataplane.CodeInvalidParameter, "max_tokens", "max_tokens must be at most", http.StatusBadRequest},
		{`{"model":"good","messages":[{"role":"user","content":"hi"}],"n":3000000,"max_tokens":1000000}`, dataplane.CodeEstimateTooLarge, "n", "lower n or max_tokens", http.StatusBadRequest},
	} {
		a := lloadPost(ctx, c, p.URL, tok, tc.body)
		require.NoError(t, a.err)
		require.Equal(t, tc.status, a.status, "%s: %s", tc.body, a.body)
		var e struct {
			Error struct {
				Type, Code, Message string
				Param               *string
			} `json:"error"`
		}
		require.NoError(t, json.Unmarshal(a.body, &e), "%s", a.body)
		require.Equal(t, tc.code, e.Error.Code, "%s", a.body)
		require.Contains(t, e.Error.Message, tc.msg)
		if tc.param != "" {
			require.NotNil(t, e.Error.Param)
			require.Equal(t, tc.param, *e.Error.Param)
		}
		require.NotContains(t, string(a.body), "Unauthorized", "not the engine's shape")
		if tc.code == dataplane.CodeUpstreamAuthFailed || tc.code == dataplane.CodeUpstreamBadRequest {
			// Body refusals come before authentication: they are not the
			// org's rows.
			answers = append(answers, a)
		}
	}
	lloadDrain(t, []*proxy{p})
	codes := map[string]string{}
	if !harness.Until(func() bool {
		d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
			rs, err := conn.Query(ctx, `SELECT request_id, error_code FROM spend_logs WHERE org_id = $1`, ten.OrgID)
			require.NoError(t, err)
			for rs.Next() {
				var id, code string
				require.NoError(t, rs.Scan(&id, &code))
				codes[id] = code
			}
			require.NoError(t, rs.Err())
		})
		return len(codes) >= len(answers)
	}, 60*time.Second, 50*time.Millisecond) {
		t.Fatalf("spend_logs has %d of %d requests; spend consumer: %s", len(codes), len(answers), d.spendConsumerInfo())
	}
	for _, a := range answers {
		require.Equal(t, a.code(), codes[a.id], "ledger error code of %s", a.id)
	}
}
