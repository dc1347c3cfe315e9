package system

import (
	"context"
	"errors"
	"net/http"
	"strings"
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

// TestAgentProtocols drives /v1/messages with the official Anthropic Go
// SDK and /v1/responses with openai-go's Responses client through a real
// data plane (config over NATS, limits in Redis, the ledger in Postgres)
// to simulated vLLM engines: answers, streams, usage charged to the key
// and team with cache tokens, typed errors of each protocol, and
// previous_response_id follow-ups pinned to the engine holding the
// Response.
func TestAgentProtocols(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	sims := []*vllmsim.Server{startSim(t), startSim(t), startSim(t)}
	ctx := context.Background()
	m := d.modelClient()
	for _, g := range []string{"claude-local", "agents", "chat-only"} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true}))
		require.NoError(t, err)
	}
	depOf := map[string]string{} // deployment id → engine URL
	dep := func(group string, sim *vllmsim.Server, protocols ...string) {
		r, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: group, ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
			Capabilities: &adminv1.Capabilities{Tools: true, Protocols: protocols},
			Prices:       &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6, CachedInputPerToken: 0.25e-6}}))
		require.NoError(t, err)
		depOf[r.Msg.Deployment.Id] = sim.URL()
	}
	dep("claude-local", sims[0], "anthropic_messages")
	for _, s := range sims {
		dep("agents", s, "openai_responses")
	}
	dep("chat-only", sims[0])
	_, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
		ModelGroup: "chat-only", ApiBase: sims[0].URL() + "/v1", UpstreamModel: vllmsim.DefaultModel,
		Capabilities: &adminv1.Capabilities{Protocols: []string{"smtp"}}, Free: true}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "an unknown protocol is refused: %v", err)

	c := d.Clients()
	ten := d.NewTenant("agents")
	i64 := func(v int64) *int64 { return &v }
	f64 := func(v float64) *float64 { return &v }
	rpmKey, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID,
		Limits: &adminv1.Limits{RpmLimit: i64(1)}}))
	require.NoError(t, err)
	poorKey, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID,
		Limits: &adminv1.Limits{MaxBudget: f64(1e-7), BudgetDuration: "1h"}}))
	require.NoError(t, err)
	blocked := d.NewTenant("agents-blocked")
	_, err = c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: blocked.KeyID}))
	require.NoError(t, err)

	p := d.StartProxy("default", time.Minute)
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("agents")) == 3 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)
	harness.WaitStatus(t, p, blocked.Token, http.StatusForbidden, 10*time.Second)

	// ledger waits for the spend_logs row of a request.
	ledger := func(id string) *spendRow {
		t.Helper()
		var row *spendRow
		harness.Eventually(t, func() bool { row = d.spendRows(t)[id]; return row != nil }, 15*time.Second, 50*time.Millisecond, "no ledger row for %s", id)
		return row
	}

	// Anthropic Messages, with an API key (x-api-key) and with an auth
	// token (Authorization: Bearer), as Claude Code sends either.
	ac := anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAPIKey(ten.Token), aoption.WithMaxRetries(0))
	prompt := "You are a coding agent. " + strings.Repeat("Keep the build green and the tests honest. ", 40)
	params := anthropic.MessageNewParams{Model: "claude-local", MaxTokens: 24,
		System:   []anthropic.TextBlockParam{{Text: prompt}},
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Fix the failing test."))},
		Tools: []anthropic.ToolUnionParam{{OfTool: &anthropic.ToolParam{Name: "run_tests",
			InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"pkg": map[string]any{"type": "string"}}}}}}}
	var hr *http.Response
	msg, err := ac.Messages.New(ctx, params, aoption.WithResponseInto(&hr))
	require.NoError(t, err)
	require.NotEmpty(t, msg.Content)
	require.NotEmpty(t, msg.Content[0].Text)
	require.Positive(t, msg.Usage.OutputTokens)
	row := ledger(hr.Header.Get(dataplane.RequestIDHeader))
	require.Equal(t, ten.KeyID, row.key)
	require.Equal(t, ten.TeamID, row.team)
	require.Equal(t, "/v1/messages", row.route)
	require.Equal(t, msg.Usage.InputTokens+msg.Usage.CacheReadInputTokens+msg.Usage.CacheCreationInputTokens, row.prompt)
	require.Equal(t, msg.Usage.OutputTokens, row.completion)

	// The same prompt again through a bearer token: the engine's prefix
	// cache serves it, and the ledger records the cache reads.
	bc := anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAuthToken(ten.Token), aoption.WithMaxRetries(0))
	msg2, err := bc.Messages.New(ctx, params, aoption.WithResponseInto(&hr))
	require.NoError(t, err)
	require.Positive(t, msg2.Usage.CacheReadInputTokens, "the repeated prompt is read from the prefix cache")
	row = ledger(hr.Header.Get(dataplane.RequestIDHeader))
	require.Equal(t, msg2.Usage.CacheReadInputTokens, row.cached)
	require.Equal(t, msg2.Usage.InputTokens+msg2.Usage.CacheReadInputTokens, row.prompt)

	// Streaming: the SDK's accumulator sees every event and the usage.
	stream := ac.Messages.NewStreaming(ctx, params, aoption.WithResponseInto(&hr))
	var acc anthropic.Message
	kinds := map[string]int{}
	for stream.Next() {
		ev := stream.Current()
		kinds[ev.Type]++
		require.NoError(t, acc.Accumulate(ev))
	}
	require.NoError(t, stream.Err())
	for _, k := range []string{"message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"} {
		require.Positive(t, kinds[k], "event %s relayed (%v)", k, kinds)
	}
	require.NotEmpty(t, acc.Content[0].Text)
	require.Positive(t, acc.Usage.OutputTokens)
	row = ledger(hr.Header.Get(dataplane.RequestIDHeader))
	require.True(t, row.stream)
	require.Equal(t, acc.Usage.OutputTokens, row.completion)
	require.Equal(t, acc.Usage.CacheReadInputTokens, row.cached)
	require.Equal(t, ten.KeyID, row.key)

	// Typed Anthropic errors.
	check := func(name, tok string, pr anthropic.MessageNewParams, status int, typ string) *anthropic.Error {
		var resp *http.Response
		cl := anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAPIKey(tok), aoption.WithMaxRetries(0))
		_, err := cl.Messages.New(ctx, pr, aoption.WithResponseInto(&resp))
		var ae *anthropic.Error
		require.True(t, errors.As(err, &ae), "%s: %v", name, err)
		require.Equal(t, status, ae.StatusCode, "%s: %s", name, ae.RawJSON())
		require.Equal(t, typ, string(ae.Type()), "%s: %s", name, ae.RawJSON())
		return ae
	}
	_ = check("bad key", "sk-sluice-nope", params, 401, "authentication_error")
	_ = check("blocked key", blocked.Token, params, 403, "permission_error")
	other := params
	other.Model = "chat-only"
	require.Contains(t, check("no deployment speaks the protocol", ten.Token, other, 400, "invalid_request_error").RawJSON(), "protocol_not_served")
	other.Model = "nope"
	_ = check("unknown model", ten.Token, other, 404, "not_found_error")
	// The key's one request a minute, then a typed rate limit with
	// retry-after and the limits in both header families.
	rc := anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAPIKey(rpmKey.Msg.Token), aoption.WithMaxRetries(0))
	_, err = rc.Messages.New(ctx, params, aoption.WithResponseInto(&hr))
	require.NoError(t, err)
	require.Equal(t, "1", hr.Header.Get("Anthropic-Ratelimit-Requests-Limit"))
	require.Equal(t, "1", hr.Header.Get("X-Ratelimit-Limit-Requests"))
	_, err = time.Parse(time.RFC3339, hr.Header.Get("Anthropic-Ratelimit-Requests-Reset"))
	require.NoError(t, err, "reset %q", hr.Header.Get("Anthropic-Ratelimit-Requests-Reset"))
	ae := check("rate limited", rpmKey.Msg.Token, params, 429, "rate_limit_error")
	require.NotEmpty(t, ae.Response.Header.Get("Retry-After"))
	require.Equal(t, "0", ae.Response.Header.Get("Anthropic-Ratelimit-Requests-Remaining"))
	// A budget smaller than one request: the first one spends it, the
	// next are refused once it has settled.
	pc := anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAPIKey(poorKey.Msg.Token), aoption.WithMaxRetries(0))
	_, err = pc.Messages.New(ctx, params)
	require.NoError(t, err)
	harness.Eventually(t, func() bool {
		_, err := pc.Messages.New(ctx, params)
		var ae *anthropic.Error
		return errors.As(err, &ae) && ae.StatusCode == 429
	}, 10*time.Second, 50*time.Millisecond, "the spent budget is never enforced")
	require.Contains(t, check("over budget", poorKey.Msg.Token, params, 429, "rate_limit_error").RawJSON(), "budget_exceeded")

	// OpenAI Responses through openai-go.
	oc := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(ten.Token), option.WithMaxRetries(0))
	rp := responses.ResponseNewParams{Model: "agents", MaxOutputTokens: openai.Int(16),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Plan the refactor.")}}
	first, err := oc.Responses.New(ctx, rp, option.WithResponseInto(&hr))
	require.NoError(t, err)
	require.NotEmpty(t, first.OutputText())
	require.Positive(t, first.Usage.OutputTokens)
	row = ledger(hr.Header.Get(dataplane.RequestIDHeader))
	require.Equal(t, "/v1/responses", row.route)
	require.Equal(t, first.Usage.InputTokens, row.prompt)
	require.Equal(t, first.Usage.OutputTokens, row.completion)
	require.Equal(t, ten.KeyID, row.key)
	home := row.dep

	// Follow-ups chained on previous_response_id all land on the engine
	// holding the conversation (another engine would answer 404).
	prev := first.ID
	for i := range 6 {
		rp.PreviousResponseID = openai.String(prev)
		rp.Input = responses.ResponseNewParamsInputUnion{OfString: openai.String("And then?")}
		next, err := oc.Responses.New(ctx, rp, option.WithResponseInto(&hr))
		require.NoError(t, err, "follow-up %d", i)
		require.Equal(t, home, ledger(hr.Header.Get(dataplane.RequestIDHeader)).dep, "follow-up %d left the engine holding the response", i)
		prev = next.ID
	}
	got, err := oc.Responses.Get(ctx, prev, responses.ResponseGetParams{})
	require.NoError(t, err)
	require.Equal(t, prev, got.ID)

	// Streaming: response.* events relayed, usage from response.completed.
	rp.PreviousResponseID = openai.String(prev)
	rs := oc.Responses.NewStreaming(ctx, rp, option.WithResponseInto(&hr))
	var completed responses.Response
	var deltas int
	for rs.Next() {
		ev := rs.Current()
		switch ev.Type {
		case "response.output_text.delta":
			deltas++
		case "response.completed", "response.incomplete":
			completed = ev.Response
		}
	}
	require.NoError(t, rs.Err())
	require.Positive(t, deltas)
	require.Positive(t, completed.Usage.OutputTokens)
	row = ledger(hr.Header.Get(dataplane.RequestIDHeader))
	require.Equal(t, home, row.dep)
	require.Equal(t, completed.Usage.InputTokens, row.prompt)
	require.Equal(t, completed.Usage.OutputTokens, row.completion)
	require.Equal(t, completed.Usage.InputTokensDetails.CachedTokens, row.cached)

	// A Response another key created, or none, is not found.
	rp.PreviousResponseID = openai.String("resp_unknown")
	_, err = oc.Responses.New(ctx, rp)
	var oe *openai.Error
	require.True(t, errors.As(err, &oe), "%v", err)
	require.Equal(t, 400, oe.StatusCode)
	require.Equal(t, "previous_response_not_found", oe.Code)
	other2 := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(rpmKey.Msg.Token), option.WithMaxRetries(0))
	_, err = other2.Responses.Get(ctx, prev, responses.ResponseGetParams{})
	require.True(t, errors.As(err, &oe), "%v", err)
	require.Equal(t, 404, oe.StatusCode)
	// A group without a Responses deployment.
	rp.PreviousResponseID = param.Opt[string]{}
	rp.Model = "chat-only"
	_, err = oc.Responses.New(ctx, rp)
	require.True(t, errors.As(err, &oe), "%v", err)
	require.Equal(t, "protocol_not_served", oe.Code)
}
