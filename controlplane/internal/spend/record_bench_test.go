package spend

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/testsvc"
	usagev1 "github.com/sluicegw/sluice/proto/gen/sluice/usage/v1"
)

// BenchmarkSpendRecord measures the control plane's Go work per usage
// event (decoding a batch, converting it, recording it in Postgres):
// each op is one event, recorded in transactions of 512.
func BenchmarkSpendRecord(b *testing.B) {
	pool, _ := testsvc.NewPool(b)
	st := store.New(pool, nil)
	ctx := context.Background()
	const per = 512
	seq := 0
	batch := func() []byte {
		bt := &usagev1.UsageBatch{BatchId: fmt.Sprint(seq)}
		for range per {
			seq++
			bt.Events = append(bt.Events, &usagev1.UsageEvent{
				RequestId: fmt.Sprintf("req_bench_%09d", seq), Time: timestamppb.Now(), Region: "default",
				InstanceId: "bench-dp", KeyId: fmt.Sprintf("key_%d", seq%50), UserId: "user_1", TeamId: fmt.Sprintf("team_%d", seq%5),
				OrgId: "org_bench", Project: "bench", TrafficClass: "interactive", Route: "/v1/chat/completions",
				RequestedModel: "bench", ModelGroup: "bench", DeploymentId: "dep_bench", PromptTokens: 42, CompletionTokens: 38,
				CostUsd: 42e-6 + 76e-6, Status: 200, LatencyMs: 3, Attempts: 1, TrafficClassReason: "default", RoutingReason: "load",
			})
		}
		data, err := proto.Marshal(bt)
		require.NoError(b, err)
		return data
	}
	var datas [][]byte
	for range b.N/per + 1 {
		datas = append(datas, batch())
	}
	b.ResetTimer()
	for _, data := range datas {
		logs, rejected, err := decodeBatch(data, time.Now)
		require.NoError(b, err)
		require.Empty(b, rejected)
		res, err := st.SpendRecord(ctx, logs)
		require.NoError(b, err)
		require.Equal(b, per, res.Inserted)
	}
}
