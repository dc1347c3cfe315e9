package spend

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

var storedAt = time.Date(2026, 11, 4, 1, 2, 3, 0, time.UTC)

// decodeBatchProto is the reference: the generated code's decoding and
// FromEvent, as the ledger read batches before decodeBatch.
func decodeBatchProto(data []byte) ([]store.SpendLog, int, error) {
	b := &usagev1.UsageBatch{}
	if err := proto.Unmarshal(data, b); err != nil {
		return nil, 0, err
	}
	var logs []store.SpendLog
	rejected := 0
	for _, ev := range b.GetEvents() {
		if ev.GetRequestId() == "" {
			rejected++
			continue
		}
		at := storedAt
		if ev.GetTime() != nil && ev.GetTime().CheckValid() == nil {
			at = ev.GetTime().AsTime()
		}
		logs = append(logs, FromEvent(ev, at))
	}
	return logs, rejected, nil
}

func requireSameDecoding(t *testing.T, data []byte, what string) {
	t.Helper()
	want, wantRejected, wantErr := decodeBatchProto(data)
	got, rejected, err := decodeBatch(data, func() time.Time { return storedAt })
	if wantErr != nil {
		require.Error(t, err, "%s: the generated code refuses it (%v)", what, wantErr)
		return
	}
	require.NoError(t, err, what)
	require.Len(t, rejected, wantRejected, what)
	require.Len(t, got, len(want), what)
	for i := range want {
		if len(want[i].Tags) == 0 && len(got[i].Tags) == 0 {
			want[i].Tags, got[i].Tags = nil, nil
		}
		require.Equal(t, want[i], got[i], "%s: event %d", what, i)
	}
}

// TestBatchDecodingMatchesGeneratedCode: the hand decoder reads every batch
// exactly as proto.Unmarshal and FromEvent do — fields set and unset,
// NUL bytes, repeated tags, events without a time or with an invalid one,
// unknown fields, repeated fields (the last wins, a repeated time merges),
// wrong wire types — and refuses what proto.Unmarshal refuses (truncated
// data, invalid UTF-8 in any string field, kept by the ledger or not);
// then the same over thousands of random corruptions of a valid batch.
func TestBatchDecodingMatchesGeneratedCode(t *testing.T) {
	t.Parallel()
	full := &usagev1.UsageEvent{RequestId: "req_full", Time: timestamppb.New(time.Date(2026, 11, 3, 23, 59, 58, 123456789, time.UTC)),
		Region: "eu", InstanceId: "dp-1", KeyId: "key_1", UserId: "user_1", TeamId: "team_1", OrgId: "org_1", Project: "p",
		Customer: "acme", AgentId: "agent", SessionId: "sess", Tags: []string{"a", "a\x00b", "ünï"}, TrafficClass: "batch",
		Route: "/v1/x", RequestedModel: "m\x00", ModelGroup: "g", DeploymentId: "dep", Stream: true, PromptTokens: 1 << 40,
		CompletionTokens: 7, CachedTokens: 3, CostUsd: 0.3, Status: -5, ErrorCode: "e", LatencyMs: -1, TtftMs: 9, Attempts: 3,
		TrafficClassReason: "default", RoutingReason: "load", CacheCreationTokens: 2, ServedModelGroup: "g2"}
	events := []*usagev1.UsageEvent{
		full,
		{RequestId: "req_no_time"},
		{RequestId: "req_bad_time", Time: &timestamppb.Timestamp{Seconds: 1, Nanos: -1}},
		{RequestId: "req_far_time", Time: &timestamppb.Timestamp{Seconds: 253402300800}},
		{RequestId: ""}, // rejected
		{RequestId: "req_zero_time", Time: &timestamppb.Timestamp{}},
	}
	batch := &usagev1.UsageBatch{BatchId: "b-1", Events: events}
	data, err := proto.Marshal(batch)
	require.NoError(t, err)
	requireSameDecoding(t, data, "the batch")
	requireSameDecoding(t, nil, "an empty batch")

	evBytes, err := proto.Marshal(full)
	require.NoError(t, err)
	wrap := func(ev []byte) []byte {
		b := protowire.AppendTag(nil, fBatchEvents, protowire.BytesType)
		return protowire.AppendBytes(b, ev)
	}
	str := func(b []byte, num protowire.Number, s string) []byte {
		b = protowire.AppendTag(b, num, protowire.BytesType)
		return protowire.AppendString(b, s)
	}
	varint := func(b []byte, num protowire.Number, v uint64) []byte {
		b = protowire.AppendTag(b, num, protowire.VarintType)
		return protowire.AppendVarint(b, v)
	}
	ts := func(sec, nanos uint64) []byte {
		var t []byte
		if sec != 0 {
			t = varint(t, fSeconds, sec)
		}
		if nanos != 0 {
			t = varint(t, fNanos, nanos)
		}
		b := protowire.AppendTag(nil, fTime, protowire.BytesType)
		return protowire.AppendBytes(b, t)
	}
	cases := map[string][]byte{
		"repeated fields: the last wins":        wrap(str(varint(str(evBytes, fRequestID, "req_second"), fStatus, 201), fOrgID, "org_2")),
		"a repeated time merges":                wrap(append(append(str(nil, fRequestID, "r"), ts(1700000000, 0)...), ts(0, 5)...)),
		"unknown fields are skipped":            wrap(varint(str(str(evBytes, 999, "x"), 121, "y"), 5000, 1)),
		"a wrong wire type is an unknown field": wrap(varint(varint(str(nil, fRequestID, "r"), fRegion, 3), fCostUSD, 4)),
		"invalid UTF-8 in a kept string":        wrap(str(evBytes, fRegion, "\xff")),
		"invalid UTF-8 in a tag":                wrap(str(evBytes, fTags, "\xc3")),
		"invalid UTF-8 in an unkept string":     wrap(str(evBytes, fRoutingReason, "\xff")),
		"invalid UTF-8 in the batch id":         str(wrap(evBytes), fBatchID, "\xff"),
		"invalid UTF-8 in an unknown field":     wrap(str(evBytes, 777, "\xff")),
		"truncated":                             wrap(evBytes)[:len(evBytes)-3],
		"a negative int32":                      wrap(varint(str(nil, fRequestID, "r"), fAttempts, uint64(0xffffffffffffffff))),
		"batch fields of an event are skipped":  wrap(str(str(nil, fRequestID, "r"), fBatchEvents, "zz")),
	}
	for what, data := range cases {
		requireSameDecoding(t, data, what)
	}

	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 5000 {
		c := append([]byte(nil), data...)
		for range 1 + rng.IntN(3) {
			switch rng.IntN(3) {
			case 0:
				c[rng.IntN(len(c))] = byte(rng.IntN(256))
			case 1:
				c = c[:rng.IntN(len(c))]
			case 2:
				j := rng.IntN(len(c))
				c = append(c[:j:j], append([]byte{byte(rng.IntN(256))}, c[j:]...)...)
			}
			if len(c) == 0 {
				break
			}
		}
		requireSameDecoding(t, c, "corruption "+string(rune('0'+i%10)))
	}
}

// FuzzBatchDecoding: whatever bytes arrive on the usage stream, the hand
// decoder answers exactly as the generated code does (same rows, same
// rejections, an error where proto.Unmarshal errs), and never panics.
func FuzzBatchDecoding(f *testing.F) {
	ev := &usagev1.UsageEvent{RequestId: "req_1", Time: timestamppb.New(storedAt), OrgId: "org_1", KeyId: "key_1",
		Tags: []string{"a", "b"}, PromptTokens: 12, CompletionTokens: 3, CostUsd: 0.25, Status: 200, Attempts: 1}
	for _, b := range []*usagev1.UsageBatch{
		{BatchId: "b-1", Events: []*usagev1.UsageEvent{ev, {RequestId: ""}, {RequestId: "req_2"}}},
		{},
	} {
		data, err := proto.Marshal(b)
		require.NoError(f, err)
		f.Add(data)
	}
	f.Add([]byte{0x0a, 0x03, 0x0a, 0x01, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		requireSameDecoding(t, data, "fuzzed batch")
	})
}
