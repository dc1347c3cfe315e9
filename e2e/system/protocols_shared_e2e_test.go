package system

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/packages/param"
	"github.com/openai/openai-go/v3/responses"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// countingFront forwards to a proxy and records when each request arrived,
// so a test sees every call a stock SDK made, retries included.
type countingFront struct {
	srv *httptest.Server
	mu  sync.Mutex
	at  []time.Time
}

func newCountingFront(t *testing.T, target string) *countingFront {
	t.Helper()
	u, err := url.Parse(target)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1
	f := &countingFront{}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.at = append(f.at, time.Now())
		f.mu.Unlock()
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

// take returns the arrival times recorded so far and forgets them.
func (f *countingFront) take() []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := f.at
	f.at = nil
	return out
}

// TestProtocolsShareLimitsAndSDKRetries: a key's limits are one window and
// one budget across chat completions, Anthropic Messages and OpenAI
// Responses; and the stock SDKs, with their default retries, retry what
// Sluice marks retryable (after its retry-after) and nothing else.
func TestProtocolsShareLimitsAndSDKRetries(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	sim := startSim(t)
	slowCfg := vllmsim.DefaultConfig()
	slowCfg.Addr, slowCfg.TimeScale, slowCfg.MeanOutputTokens = "127.0.0.1:0", 1, 4000 // ~10 ms a token: streams that last
	slow := harness.StartSim(t, slowCfg)
	ctx := context.Background()
	// The proxy runs before the org exists, so the org's creation event
	// bootstraps its limits epoch: no startup quarantine of its
	// concurrency scopes (docs/limits.md).
	p := d.StartProxy("default", time.Minute)
	m := d.modelClient()
	for g, s := range map[string]*vllmsim.Server{"shared": sim, "slow": slow} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true}))
		require.NoError(t, err)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: g, ApiBase: s.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
			Capabilities: &adminv1.Capabilities{Protocols: []string{"anthropic_messages", "openai_responses"}},
			Prices:       &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
		require.NoError(t, err)
	}
	c := d.Clients()
	ten := d.NewTenant("shared")
	i64 := func(v int64) *int64 { return &v }
	f64 := func(v float64) *float64 { return &v }
	newKey := func(l *adminv1.Limits) string {
		r, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, Limits: l}))
		require.NoError(t, err)
		return r.Msg.Token
	}
	rpmKey := newKey(&adminv1.Limits{RpmLimit: i64(3)})
	poorKey := newKey(&adminv1.Limits{MaxBudget: f64(1e-7), BudgetDuration: "1h"})
	oneKey := newKey(&adminv1.Limits{MaxParallelRequests: i64(1)})

	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("slow")) == 1 }, 10*time.Second, 10*time.Millisecond)
	for _, tok := range []string{ten.Token, rpmKey, poorKey, oneKey} {
		harness.WaitStatus(t, p, tok, http.StatusOK, 10*time.Second) // /v1/auth/check takes no limits
	}
	front := newCountingFront(t, p.URL)

	// One call of each protocol, by key, through the stock SDKs.
	chat := func(tok string, retries int) error {
		oc := openai.NewClient(option.WithBaseURL(front.srv.URL+"/v1"), option.WithAPIKey(tok), option.WithMaxRetries(retries))
		_, err := oc.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "shared", MaxTokens: openai.Int(8),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hello.")}})
		return err
	}
	messages := func(tok string, retries int) error {
		ac := anthropic.NewClient(aoption.WithBaseURL(front.srv.URL), aoption.WithAPIKey(tok), aoption.WithMaxRetries(retries))
		_, err := ac.Messages.New(ctx, anthropic.MessageNewParams{Model: "shared", MaxTokens: 8,
			Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hello."))}})
		return err
	}
	respond := func(tok string, retries int) error {
		oc := openai.NewClient(option.WithBaseURL(front.srv.URL+"/v1"), option.WithAPIKey(tok), option.WithMaxRetries(retries))
		_, err := oc.Responses.New(ctx, responses.ResponseNewParams{Model: "shared", MaxOutputTokens: openai.Int(16),
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Hello.")}})
		return err
	}
	protocols := []struct {
		name string
		call func(tok string, retries int) error
	}{{"chat", chat}, {"messages", messages}, {"responses", respond}}
	// code is the Sluice error code of an SDK error of either family.
	code := func(err error) (int, string) {
		var oe *openai.Error
		if errors.As(err, &oe) {
			return oe.StatusCode, oe.Code
		}
		var ae *anthropic.Error
		if errors.As(err, &ae) {
			var body struct {
				Error struct{ Code string } `json:"error"`
			}
			_ = json.Unmarshal([]byte(ae.RawJSON()), &body)
			return ae.StatusCode, body.Error.Code
		}
		return 0, err.Error()
	}

	// One rpm window: three requests, one per protocol, fill it; the
	// fourth is refused whichever protocol sends it.
	for _, pr := range protocols {
		require.NoError(t, pr.call(rpmKey, 0), "%s within the window", pr.name)
	}
	for _, pr := range protocols {
		st, cd := code(pr.call(rpmKey, 0))
		require.Equal(t, http.StatusTooManyRequests, st, "%s after the window filled on other protocols", pr.name)
		require.Equal(t, "rate_limit_exceeded", cd, pr.name)
	}

	// One budget: a Message spends it; then chat and Responses are refused
	// too, and the SDKs with their default retries (2) do not retry an
	// answer marked x-should-retry: false — one call each.
	require.NoError(t, messages(poorKey, 0))
	harness.Eventually(t, func() bool {
		_, cd := code(chat(poorKey, 0))
		return cd == "budget_exceeded"
	}, 15*time.Second, 50*time.Millisecond, "the budget spent on /v1/messages never refused chat")
	for _, pr := range protocols {
		front.take()
		st, cd := code(pr.call(poorKey, 2))
		require.Equal(t, http.StatusTooManyRequests, st, pr.name)
		require.Equal(t, "budget_exceeded", cd, pr.name)
		require.Len(t, front.take(), 1, "%s: the SDK retried a budget refusal (x-should-retry: false)", pr.name)
	}

	// One concurrency cap: a stream on chat holds the key's only slot;
	// each protocol's SDK, with its default retries, is refused, retries
	// twice no sooner than the retry-after Sluice sent, and gives up.
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	oc := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(oneKey), option.WithMaxRetries(0))
	hold := oc.Chat.Completions.NewStreaming(sctx, openai.ChatCompletionNewParams{Model: "slow", MaxTokens: openai.Int(3000),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Tell a long story.")}})
	if !hold.Next() {
		var oe *openai.Error
		if errors.As(hold.Err(), &oe) {
			t.Fatalf("the holding stream did not start: %s", oe.RawJSON())
		}
		t.Fatalf("the holding stream did not start: %v", hold.Err())
	}
	for _, pr := range protocols {
		front.take()
		var hr *http.Response
		var err error
		switch pr.name {
		case "chat":
			cl := openai.NewClient(option.WithBaseURL(front.srv.URL+"/v1"), option.WithAPIKey(oneKey))
			_, err = cl.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "shared", MaxTokens: openai.Int(8),
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hello.")}}, option.WithResponseInto(&hr))
		case "messages":
			cl := anthropic.NewClient(aoption.WithBaseURL(front.srv.URL), aoption.WithAPIKey(oneKey))
			_, err = cl.Messages.New(ctx, anthropic.MessageNewParams{Model: "shared", MaxTokens: 8,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hello."))}}, aoption.WithResponseInto(&hr))
		case "responses":
			cl := openai.NewClient(option.WithBaseURL(front.srv.URL+"/v1"), option.WithAPIKey(oneKey))
			_, err = cl.Responses.New(ctx, responses.ResponseNewParams{Model: "shared", MaxOutputTokens: openai.Int(16),
				Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Hello.")}}, option.WithResponseInto(&hr))
		}
		st, cd := code(err)
		require.Equal(t, http.StatusTooManyRequests, st, pr.name)
		require.Equal(t, "concurrency_limit_exceeded", cd, pr.name)
		require.NotNil(t, hr, pr.name)
		require.NotEqual(t, "false", hr.Header.Get("X-Should-Retry"), "%s: a concurrency refusal is retryable", pr.name)
		wait, perr := strconv.Atoi(hr.Header.Get("Retry-After-Ms"))
		require.NoError(t, perr, "%s: retry-after-ms %q", pr.name, hr.Header.Get("Retry-After-Ms"))
		calls := front.take()
		require.Len(t, calls, 3, "%s: one call and the SDK's two default retries", pr.name)
		for i := 1; i < len(calls); i++ {
			gap := calls[i].Sub(calls[i-1])
			require.GreaterOrEqual(t, gap, time.Duration(wait)*time.Millisecond*9/10,
				"%s: retry %d after %s, before the retry-after-ms %d Sluice sent", pr.name, i, gap, wait)
		}
	}
	stop()
	_ = hold.Close()
}

// TestResponsesFollowUpWhoseEngineIsGone: previous_response_id over 3
// engines, then the engine holding the conversation goes away: while its
// deployment exists but cannot serve (its engine down) the follow-up is a
// typed error, never a silent miss on another engine (which would answer
// 404 from its own store); once the deployment is deleted it is 400
// previous_response_unavailable, telling the client to start over.
func TestResponsesFollowUpWhoseEngineIsGone(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	p := d.StartProxy("default", time.Minute)
	sims := []*vllmsim.Server{startSim(t), startSim(t), startSim(t)}
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "agents", PlatformWide: true}))
	require.NoError(t, err)
	simOf := map[string]*vllmsim.Server{} // deployment id → engine
	for _, s := range sims {
		r, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: "agents", ApiBase: s.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, Free: true,
			Capabilities: &adminv1.Capabilities{Protocols: []string{"openai_responses"}}}))
		require.NoError(t, err)
		simOf[r.Msg.Deployment.Id] = s
	}
	ten := d.NewTenant("agents")
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("agents")) == 3 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)

	oc := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(ten.Token), option.WithMaxRetries(0))
	rp := responses.ResponseNewParams{Model: "agents", MaxOutputTokens: openai.Int(8),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Plan the refactor.")}}
	var hr *http.Response
	first, err := oc.Responses.New(ctx, rp, option.WithResponseInto(&hr))
	require.NoError(t, err)
	var home string
	harness.Eventually(t, func() bool {
		if row := d.spendRows(t)[hr.Header.Get(dataplane.RequestIDHeader)]; row != nil {
			home = row.dep
		}
		return home != ""
	}, 15*time.Second, 50*time.Millisecond, "no ledger row for the first response")
	prev := first.ID
	for i := range 5 {
		rp.PreviousResponseID = openai.String(prev)
		next, err := oc.Responses.New(ctx, rp)
		require.NoError(t, err, "follow-up %d", i)
		prev = next.ID
	}
	rp.PreviousResponseID = openai.String(prev)

	// The engine holding the conversation stops answering.
	require.NoError(t, simOf[home].SetRefuseConnections(true))
	var oe *openai.Error
	_, err = oc.Responses.New(ctx, rp)
	require.True(t, errors.As(err, &oe), "%v", err)
	require.GreaterOrEqual(t, oe.StatusCode, 500, "%s", oe.RawJSON())
	require.Contains(t, []string{"upstream_error", "previous_response_unavailable"}, oe.Code, "%s", oe.RawJSON())
	// The ledger row says which deployment the failed follow-up tried:
	// only the one holding the conversation.
	failedID := oe.Response.Header.Get(dataplane.RequestIDHeader)
	harness.Eventually(t, func() bool { return d.spendRows(t)[failedID] != nil }, 15*time.Second, 50*time.Millisecond, "no ledger row for the failed follow-up")
	row := d.spendRows(t)[failedID]
	require.Contains(t, []string{home, ""}, row.dep, "the follow-up went to another engine")
	require.GreaterOrEqual(t, row.status, int32(500))

	// The deployment is deleted: the conversation cannot continue here.
	_, err = m.DeleteDeployment(ctx, connect.NewRequest(&adminv1.DeleteDeploymentRequest{Id: home}))
	require.NoError(t, err)
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("agents")) == 2 }, 10*time.Second, 10*time.Millisecond)
	_, err = oc.Responses.New(ctx, rp)
	require.True(t, errors.As(err, &oe), "%v", err)
	require.Equal(t, http.StatusBadRequest, oe.StatusCode, "%s", oe.RawJSON())
	require.Equal(t, "previous_response_unavailable", oe.Code, "%s", oe.RawJSON())
	// A new conversation is served by the remaining engines.
	rp.PreviousResponseID = param.Opt[string]{}
	_, err = oc.Responses.New(ctx, rp)
	require.NoError(t, err)
}
