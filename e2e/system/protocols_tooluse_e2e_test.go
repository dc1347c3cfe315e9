package system

import (
	"context"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestAgentProtocolToolUse: an engine answering with a tool call reaches
// the official SDKs intact through a real data plane, streamed and not —
// an Anthropic tool_use block (id, name, input JSON, stop_reason
// "tool_use") and a Responses function_call item (call id, name,
// arguments) — and each request's ledger row holds the engine's own
// token counts (its prompt and generation counters, not what it relayed).
func TestAgentProtocolToolUse(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	p := d.StartProxy("default", time.Minute)
	sim := startSim(t) // this test's own engine: its counters are this test's
	ctx := context.Background()
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "tooluse", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
		ModelGroup: "tooluse", ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
		Prices:       &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 2e-6},
		Capabilities: &adminv1.Capabilities{Tools: true, Protocols: []string{"anthropic_messages", "openai_responses"}}}))
	require.NoError(t, err)
	ten := d.NewTenant("tooluse")
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().Deployments("tooluse")) == 1 }, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)

	// The simulator's forced call sets every schema property by its type
	// (docs/vllm-sim.md): this is the input the client must receive.
	const wantInput = `{"pkg":"sim","verbose":true}`
	schema := map[string]any{"pkg": map[string]any{"type": "string"}, "verbose": map[string]any{"type": "boolean"}}

	// engine runs one request and returns the engine's own prompt and
	// generation token counts for it (requests run one at a time).
	engine := func(run func()) (prompt, generated int64) {
		t.Helper()
		before := sim.Stats()
		run()
		var after vllmsim.Stats
		harness.Eventually(t, func() bool {
			after = sim.Stats()
			return after.FinishedStop+after.FinishedLength == before.FinishedStop+before.FinishedLength+1
		}, 10*time.Second, 5*time.Millisecond, "the engine to finish the request")
		return int64(after.PromptTokens - before.PromptTokens), int64(after.GenerationTokens - before.GenerationTokens)
	}
	ledger := func(id string) *spendRow {
		t.Helper()
		var row *spendRow
		harness.Eventually(t, func() bool { row = d.spendRows(t)[id]; return row != nil }, 15*time.Second, 50*time.Millisecond, "no ledger row for %s", id)
		return row
	}

	ac := anthropic.NewClient(aoption.WithBaseURL(p.URL), aoption.WithAPIKey(ten.Token), aoption.WithMaxRetries(0))
	params := anthropic.MessageNewParams{Model: "tooluse", MaxTokens: 24,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Run the tests of ./pkg."))},
		Tools: []anthropic.ToolUnionParam{
			{OfTool: &anthropic.ToolParam{Name: "read_file", InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"path": map[string]any{"type": "string"}}}}},
			{OfTool: &anthropic.ToolParam{Name: "run_tests", InputSchema: anthropic.ToolInputSchemaParam{Properties: schema}}}},
		ToolChoice: anthropic.ToolChoiceUnionParam{OfTool: &anthropic.ToolChoiceToolParam{Name: "run_tests"}}}

	t.Run("messages", func(t *testing.T) {
		var hr *http.Response
		var msg *anthropic.Message
		prompt, generated := engine(func() {
			var err error
			msg, err = ac.Messages.New(ctx, params, aoption.WithResponseInto(&hr))
			require.NoError(t, err)
		})
		require.Len(t, msg.Content, 1)
		require.Equal(t, "tool_use", string(msg.Content[0].Type))
		tu := msg.Content[0].AsToolUse()
		require.Equal(t, "run_tests", tu.Name)
		require.Regexp(t, `^toolu_`, tu.ID)
		require.JSONEq(t, wantInput, string(tu.Input))
		require.Equal(t, "tool_use", string(msg.StopReason))
		require.Equal(t, prompt, msg.Usage.InputTokens+msg.Usage.CacheReadInputTokens+msg.Usage.CacheCreationInputTokens)
		require.Equal(t, generated, msg.Usage.OutputTokens)
		row := ledger(hr.Header.Get(dataplane.RequestIDHeader))
		require.Equal(t, "/v1/messages", row.route)
		require.Equal(t, prompt, row.prompt)
		require.Equal(t, generated, row.completion)
		require.Positive(t, row.cost)
	})

	t.Run("messages_stream", func(t *testing.T) {
		var hr *http.Response
		var acc anthropic.Message
		deltas := 0
		prompt, generated := engine(func() {
			stream := ac.Messages.NewStreaming(ctx, params, aoption.WithResponseInto(&hr))
			for stream.Next() {
				ev := stream.Current()
				require.NoError(t, acc.Accumulate(ev))
				if ev.Type == "content_block_delta" && ev.Delta.Type == "input_json_delta" {
					deltas++
				}
			}
			require.NoError(t, stream.Err())
		})
		require.Positive(t, deltas, "the input arrives as input_json_delta events")
		require.Len(t, acc.Content, 1)
		tu := acc.Content[0].AsToolUse()
		require.Equal(t, "tool_use", string(acc.Content[0].Type))
		require.Equal(t, "run_tests", tu.Name)
		require.Regexp(t, `^toolu_`, tu.ID)
		require.JSONEq(t, wantInput, string(tu.Input))
		require.Equal(t, "tool_use", string(acc.StopReason))
		require.Equal(t, generated, acc.Usage.OutputTokens)
		row := ledger(hr.Header.Get(dataplane.RequestIDHeader))
		require.True(t, row.stream)
		require.Equal(t, prompt, row.prompt)
		require.Equal(t, generated, row.completion)
	})

	oc := openai.NewClient(option.WithBaseURL(p.URL+"/v1"), option.WithAPIKey(ten.Token), option.WithMaxRetries(0))
	rparams := responses.ResponseNewParams{Model: "tooluse", MaxOutputTokens: openai.Int(24),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("Run the tests of ./pkg.")},
		Tools: []responses.ToolUnionParam{{OfFunction: &responses.FunctionToolParam{Name: "run_tests",
			Parameters: map[string]any{"type": "object", "properties": schema}}}},
		ToolChoice: responses.ResponseNewParamsToolChoiceUnion{OfToolChoiceMode: openai.Opt(responses.ToolChoiceOptionsRequired)}}
	checkCall := func(t *testing.T, item responses.ResponseOutputItemUnion) {
		t.Helper()
		require.Equal(t, "function_call", item.Type)
		fc := item.AsFunctionCall()
		require.Equal(t, "run_tests", fc.Name)
		require.Regexp(t, `^call_`, fc.CallID)
		require.JSONEq(t, wantInput, fc.Arguments)
	}

	t.Run("responses", func(t *testing.T) {
		var hr *http.Response
		var resp *responses.Response
		prompt, generated := engine(func() {
			var err error
			resp, err = oc.Responses.New(ctx, rparams, option.WithResponseInto(&hr))
			require.NoError(t, err)
		})
		require.Len(t, resp.Output, 1)
		checkCall(t, resp.Output[0])
		require.Equal(t, prompt, resp.Usage.InputTokens)
		require.Equal(t, generated, resp.Usage.OutputTokens)
		row := ledger(hr.Header.Get(dataplane.RequestIDHeader))
		require.Equal(t, "/v1/responses", row.route)
		require.Equal(t, prompt, row.prompt)
		require.Equal(t, generated, row.completion)
	})

	t.Run("responses_stream", func(t *testing.T) {
		var hr *http.Response
		var done responses.ResponseOutputItemUnion
		var completed *responses.Response
		var args string
		prompt, generated := engine(func() {
			stream := oc.Responses.NewStreaming(ctx, rparams, option.WithResponseInto(&hr))
			for stream.Next() {
				switch ev := stream.Current(); ev.Type {
				case "response.function_call_arguments.delta":
					args += ev.AsResponseFunctionCallArgumentsDelta().Delta
				case "response.output_item.done":
					done = ev.AsResponseOutputItemDone().Item
				case "response.completed":
					r := ev.AsResponseCompleted().Response
					completed = &r
				}
			}
			require.NoError(t, stream.Err())
		})
		require.JSONEq(t, wantInput, args, "the argument deltas add up to the arguments")
		checkCall(t, done)
		require.NotNil(t, completed)
		require.Len(t, completed.Output, 1)
		checkCall(t, completed.Output[0])
		require.Equal(t, generated, completed.Usage.OutputTokens)
		row := ledger(hr.Header.Get(dataplane.RequestIDHeader))
		require.True(t, row.stream)
		require.Equal(t, prompt, row.prompt)
		require.Equal(t, generated, row.completion)
	})
}
