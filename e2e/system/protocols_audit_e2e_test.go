package system

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/jackc/pgx/v5"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// sdkErr is an error of either SDK family: status, the protocol's error
// type and Sluice's code.
type sdkErr struct {
	status     int
	typ, code  string
	anthropic  bool
	rawJSON    string
	retryAfter string
}

func sdkErrOf(t *testing.T, err error) sdkErr {
	t.Helper()
	var oe *openai.Error
	if errors.As(err, &oe) {
		return sdkErr{status: oe.StatusCode, typ: oe.Type, code: oe.Code, rawJSON: oe.RawJSON(), retryAfter: oe.Response.Header.Get("Retry-After")}
	}
	var ae *anthropic.Error
	if errors.As(err, &ae) {
		var body struct {
			Type  string `json:"type"`
			Error struct {
				Type, Code string
			} `json:"error"`
		}
		require.NoError(t, json.Unmarshal([]byte(ae.RawJSON()), &body), ae.RawJSON())
		require.Equal(t, "error", body.Type, "Anthropic's error envelope: %s", ae.RawJSON())
		require.Equal(t, string(ae.Type()), body.Error.Type)
		return sdkErr{status: ae.StatusCode, typ: body.Error.Type, code: body.Error.Code, anthropic: true, rawJSON: ae.RawJSON(),
			retryAfter: ae.Response.Header.Get("Retry-After")}
	}
	t.Fatalf("not an SDK error: %v", err)
	return sdkErr{}
}

// protoCalls are one call per protocol through the stock SDKs (no
// retries), to group g of proxy url with token tok and maxTokens output
// tokens.
func protoCalls(url string) []struct {
	name string
	call func(ctx context.Context, tok, g string, maxTokens int64) error
} {
	return []struct {
		name string
		call func(ctx context.Context, tok, g string, maxTokens int64) error
	}{
		{"chat", func(ctx context.Context, tok, g string, maxTokens int64) error {
			oc := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey(tok), option.WithMaxRetries(0))
			_, err := oc.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: g, MaxTokens: openai.Int(maxTokens),
				Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hello there.")}})
			return err
		}},
		{"messages", func(ctx context.Context, tok, g string, maxTokens int64) error {
			ac := anthropic.NewClient(aoption.WithBaseURL(url), aoption.WithAPIKey(tok), aoption.WithMaxRetries(0))
			_, err := ac.Messages.New(ctx, anthropic.MessageNewParams{Model: anthropic.Model(g), MaxTokens: maxTokens,
				Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hello there."))}})
			return err
		}},
		{"responses", func(ctx context.Context, tok, g string, maxTokens int64) error {
			oc := openai.NewClient(option.WithBaseURL(url+"/v1"), option.WithAPIKey(tok), option.WithMaxRetries(0))
			_, err := oc.Responses.New(ctx, responses.ResponseNewParams{Model: g, MaxOutputTokens: openai.Int(maxTokens),
				Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Hello there.")}})
			return err
		}},
	}
}

// TestProtocolErrorsAndTokenWindow: issue 16's error list on every
// protocol through the stock SDKs — bad key, model not allowed, over
// concurrency — each in its protocol's shape (Anthropic's
// {"type":"error","error":{"type":…}} with the mapped type; OpenAI's with
// Sluice's type and code); and a key's tpm window is one window across
// chat, messages and responses: tokens spent on /v1/messages refuse the
// other two with token_rate_limit_exceeded.
func TestProtocolErrorsAndTokenWindow(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	p := d.StartProxy("default", time.Minute) // before the org: no startup quarantine of its scopes
	sim := startSim(t)
	slowCfg := vllmsim.DefaultConfig()
	slowCfg.Addr, slowCfg.TimeScale, slowCfg.MeanOutputTokens = "127.0.0.1:0", 1, 4000
	slow := harness.StartSim(t, slowCfg)
	ctx := context.Background()
	m := d.modelClient()
	for g, s := range map[string]*vllmsim.Server{"open": sim, "closed": sim, "slowp": slow} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true}))
		require.NoError(t, err)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: g, ApiBase: s.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
			Capabilities: &adminv1.Capabilities{Protocols: []string{"anthropic_messages", "openai_responses"}},
			Prices:       &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
		require.NoError(t, err)
	}
	ten := d.NewTenant("proto-errors")
	i64 := func(v int64) *int64 { return &v }
	newKey := func(l *adminv1.Limits) string {
		r, err := d.Clients().Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, Limits: l}))
		require.NoError(t, err)
		return r.Msg.Token
	}
	scoped := newKey(&adminv1.Limits{AllowedModels: []string{"open", "slowp"}, MaxParallelRequests: i64(1)})
	tpmKey := newKey(&adminv1.Limits{TpmLimit: i64(400)})
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("slowp")) == 1 }, 10*time.Second, 10*time.Millisecond)
	for _, tok := range []string{scoped, tpmKey} {
		harness.WaitStatus(t, p, tok, http.StatusOK, 10*time.Second)
	}
	calls := protoCalls(p.URL)
	for _, c := range calls {
		require.NoError(t, c.call(ctx, scoped, "open", 8), c.name)
	}

	// want is the error each protocol answers: OpenAI's type and
	// Anthropic's, for one Sluice status and code.
	check := func(name string, err error, status int, code, openaiType, anthropicType string) {
		t.Helper()
		e := sdkErrOf(t, err)
		require.Equal(t, status, e.status, "%s: %s", name, e.rawJSON)
		require.Equal(t, code, e.code, "%s: %s", name, e.rawJSON)
		if e.anthropic {
			require.Equal(t, anthropicType, e.typ, "%s: %s", name, e.rawJSON)
		} else {
			require.Equal(t, openaiType, e.typ, "%s: %s", name, e.rawJSON)
		}
	}
	for _, c := range calls {
		check(c.name+" bad key", c.call(ctx, "sk-sluice-nope", "open", 8), 401, "invalid_api_key", "invalid_request_error", "authentication_error")
		check(c.name+" model not allowed", c.call(ctx, scoped, "closed", 8), 403, "model_not_allowed", "permission_error", "permission_error")
	}

	// Over concurrency: a stream holds the key's one slot.
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	oc := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(scoped), option.WithMaxRetries(0))
	hold := oc.Chat.Completions.NewStreaming(sctx, openai.ChatCompletionNewParams{Model: "slowp", MaxTokens: openai.Int(3000),
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Tell a long story.")}})
	require.True(t, hold.Next(), "the holding stream did not start: %v", hold.Err())
	for _, c := range calls {
		err := c.call(ctx, scoped, "open", 8)
		check(c.name+" over concurrency", err, 429, "concurrency_limit_exceeded", "rate_limit_error", "rate_limit_error")
		require.NotEmpty(t, sdkErrOf(t, err).retryAfter, c.name)
	}
	stop()
	_ = hold.Close()

	// One tpm window: /v1/messages spends it (each answer's tokens are
	// charged to the window at settlement), then chat and responses with
	// the same prompt and at least the same max tokens are refused too.
	var spent int
	for ; spent < 40; spent++ {
		err := calls[1].call(ctx, tpmKey, "open", 60)
		if err != nil {
			check("messages over tpm", err, 429, "token_rate_limit_exceeded", "", "rate_limit_error")
			break
		}
	}
	require.Less(t, spent, 40, "the tpm window never filled on /v1/messages")
	require.Positive(t, spent, "the first Message was refused")
	for _, c := range []int{0, 2} {
		check(calls[c].name+" after messages filled the tpm window", calls[c].call(ctx, tpmKey, "open", 60), 429,
			"token_rate_limit_exceeded", "rate_limit_error", "")
	}
}

// TestClientDisconnectSettlesOnceEveryProtocol: issue 16's disconnect
// bullet on real services. On chat, /v1/messages and /v1/responses, a
// client leaving mid-stream cancels the engine's request (it counts an
// abort), the key's one concurrency slot is free again (the lease was
// released: the next request of the key is served), and the ledger holds
// exactly one row for the request: 499 client_closed, charged for the
// tokens the engine produced.
func TestClientDisconnectSettlesOnceEveryProtocol(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	p := d.StartProxy("default", time.Minute)
	cfg := vllmsim.DefaultConfig()
	cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens = "127.0.0.1:0", 1, 4000 // ~10 ms a token
	sim := harness.StartSim(t, cfg)
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "dc", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
		ModelGroup: "dc", ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
		Capabilities: &adminv1.Capabilities{Protocols: []string{"anthropic_messages", "openai_responses"}},
		Prices:       &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
	require.NoError(t, err)
	ten := d.NewTenant("proto-disconnect")
	one := int64(1)
	k, err := d.Clients().Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID,
		Limits: &adminv1.Limits{MaxParallelRequests: &one}}))
	require.NoError(t, err)
	tok := k.Msg.Token
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("dc")) == 1 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, tok, http.StatusOK, 10*time.Second)

	rowsOf := func(id string) int {
		var n int
		d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
			require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) FROM spend_logs WHERE request_id = $1`, id).Scan(&n))
		})
		return n
	}
	calls := protoCalls(p.URL)
	for i, c := range []struct{ route, body string }{
		{"/v1/chat/completions", `{"model":"dc","max_tokens":3000,"stream":true,"messages":[{"role":"user","content":"go on"}]}`},
		{"/v1/messages", `{"model":"dc","max_tokens":3000,"stream":true,"messages":[{"role":"user","content":"go on"}]}`},
		{"/v1/responses", `{"model":"dc","max_output_tokens":3000,"stream":true,"input":"go on"}`},
	} {
		rctx, cancel := context.WithCancel(ctx)
		req, err := http.NewRequestWithContext(rctx, http.MethodPost, p.URL+c.route, strings.NewReader(c.body))
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, c.route)
		id := resp.Header.Get(dataplane.RequestIDHeader)
		buf := make([]byte, 4096)
		for read := 0; read < 3000; { // a few events
			n, err := resp.Body.Read(buf)
			require.NoError(t, err, c.route)
			read += n
		}
		cancel()
		_ = resp.Body.Close()
		harness.Eventually(t, func() bool { return sim.Stats().FinishedAbort == uint64(i+1) }, 10*time.Second, 5*time.Millisecond,
			"%s: the engine never aborted the request", c.route)
		// The slot is free again: the key's next request (each protocol's
		// turn) is served, not refused for concurrency.
		harness.Eventually(t, func() bool { return calls[i].call(ctx, tok, "dc", 4) == nil }, 10*time.Second, 20*time.Millisecond,
			"%s: the key's concurrency slot was not released", c.route)
		var row *spendRow
		harness.Eventually(t, func() bool { row = d.spendRows(t)[id]; return row != nil }, 15*time.Second, 50*time.Millisecond, "%s: no ledger row", c.route)
		require.Equal(t, c.route, row.route)
		require.Equal(t, int32(499), row.status, c.route)
		require.Equal(t, "client_closed_request", row.code, c.route)
		require.Positive(t, row.prompt, c.route)
		require.Positive(t, row.completion, c.route)
		require.Less(t, row.completion, int64(3000), c.route)
		require.Positive(t, row.cost, c.route)
		require.Equal(t, 1, rowsOf(id), "%s: settled more than once", c.route)
	}
	// Every request settled once: one ledger row per request, no more
	// (the three cut streams, the three follow-ups and the auth checks'
	// none).
	var total int
	d.pg(t, func(ctx context.Context, conn *pgx.Conn) {
		require.NoError(t, conn.QueryRow(ctx, `SELECT count(*) - count(DISTINCT request_id) FROM spend_logs`).Scan(&total))
	})
	require.Zero(t, total, "a request has two ledger rows")
}

// TestResponsesFollowUpsAcrossProxies: the response id → deployment record
// lives in Redis, so a conversation whose turns a load balancer spreads
// over two proxies stays on the engine holding it (3 engines; every turn,
// through either proxy, is served by the first turn's deployment; another
// engine would answer 404 from its own store). Six conversations run,
// one after another, started on either proxy.
func TestResponsesFollowUpsAcrossProxies(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ps := []*proxy{d.StartProxy("default", time.Minute), d.StartProxy("default", time.Minute)}
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "agents", PlatformWide: true}))
	require.NoError(t, err)
	for range 3 {
		_, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: "agents", ApiBase: startSim(t).URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, Free: true,
			Capabilities: &adminv1.Capabilities{Protocols: []string{"openai_responses"}}}))
		require.NoError(t, err)
	}
	ten := d.NewTenant("agents-x")
	for _, p := range ps {
		harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("agents")) == 3 }, 10*time.Second, 10*time.Millisecond)
		harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)
	}
	clients := []openai.Client{
		openai.NewClient(option.WithBaseURL(ps[0].URL+"/v1"), option.WithAPIKey(ten.Token), option.WithMaxRetries(0)),
		openai.NewClient(option.WithBaseURL(ps[1].URL+"/v1"), option.WithAPIKey(ten.Token), option.WithMaxRetries(0)),
	}
	depOf := func(hr *http.Response) string {
		var dep string
		harness.Eventually(t, func() bool {
			if row := d.spendRows(t)[hr.Header.Get(dataplane.RequestIDHeader)]; row != nil {
				dep = row.dep
			}
			return dep != ""
		}, 15*time.Second, 50*time.Millisecond, "no ledger row")
		return dep
	}
	homes := map[string]bool{}
	for conv := range 6 {
		rp := responses.ResponseNewParams{Model: "agents", MaxOutputTokens: openai.Int(8),
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Plan the refactor.")}}
		var hr *http.Response
		first, err := clients[conv%2].Responses.New(ctx, rp, option.WithResponseInto(&hr))
		require.NoError(t, err)
		home := depOf(hr)
		homes[home] = true
		prev := first.ID
		for turn := range 4 {
			rp.PreviousResponseID = openai.String(prev)
			next, err := clients[(conv+turn+1)%2].Responses.New(ctx, rp, option.WithResponseInto(&hr))
			require.NoError(t, err, "conversation %d turn %d", conv, turn)
			require.Equal(t, home, depOf(hr), "conversation %d turn %d left its engine", conv, turn)
			prev = next.ID
		}
	}
	t.Logf("6 conversations over %d of the 3 engines", len(homes))
}

// TestAgentProtocolTools: issue 16's "tools" on both agent protocols
// through the stock SDKs: a request carrying tools is served by a group
// whose deployment declares the tools capability, and refused 400
// unsupported_parameter (param tools) in the protocol's shape by a group
// whose deployment does not.
func TestAgentProtocolTools(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	p := d.StartProxy("default", time.Minute)
	sim := startSim(t)
	ctx := context.Background()
	m := d.modelClient()
	for g, tools := range map[string]bool{"tooly": true, "plain": false} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true}))
		require.NoError(t, err)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: g, ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1, Free: true,
			Capabilities: &adminv1.Capabilities{Tools: tools, Protocols: []string{"anthropic_messages", "openai_responses"}}}))
		require.NoError(t, err)
	}
	ten := d.NewTenant("tools")
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("plain")) == 1 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)
	ac := anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAPIKey(ten.Token), aoption.WithMaxRetries(0))
	oc := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(ten.Token), option.WithMaxRetries(0))
	message := func(g string) error {
		_, err := ac.Messages.New(ctx, anthropic.MessageNewParams{Model: anthropic.Model(g), MaxTokens: 8,
			Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Run the tests."))},
			Tools: []anthropic.ToolUnionParam{{OfTool: &anthropic.ToolParam{Name: "run_tests",
				InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"pkg": map[string]any{"type": "string"}}}}}}})
		return err
	}
	respond := func(g string) error {
		_, err := oc.Responses.New(ctx, responses.ResponseNewParams{Model: g, MaxOutputTokens: openai.Int(8),
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Run the tests.")},
			Tools: []responses.ToolUnionParam{{OfFunction: &responses.FunctionToolParam{Name: "run_tests",
				Parameters: map[string]any{"type": "object", "properties": map[string]any{"pkg": map[string]any{"type": "string"}}}}}}})
		return err
	}
	for name, call := range map[string]func(string) error{"messages": message, "responses": respond} {
		require.NoError(t, call("tooly"), name)
		e := sdkErrOf(t, call("plain"))
		require.Equal(t, http.StatusBadRequest, e.status, "%s: %s", name, e.rawJSON)
		require.Equal(t, "unsupported_parameter", e.code, "%s: %s", name, e.rawJSON)
		require.Equal(t, "invalid_request_error", e.typ, "%s: %s", name, e.rawJSON)
		require.Contains(t, e.rawJSON, "tools", name)
	}
}
