package dataplane

import (
	"testing"

	"github.com/stretchr/testify/require"

	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// TestSeedReplyMustAnswerTheRequest: a reply is taken only when it answers
// every scope of the request, in order, with a spend; anything else is an
// error (the scope stays closed), never a guess.
func TestSeedReplyMustAnswerTheRequest(t *testing.T) {
	req := &configv1.BudgetSeedRequest{OrgId: "o", Scopes: []*configv1.BudgetSeed{
		{OrgId: "o", Kind: "key", Id: "k", Window: "1d", WindowStart: 86400},
		{OrgId: "o", Kind: "team", Id: "t", Window: "1mo", WindowStart: 0},
	}}
	seed := func(kind, id, w string, start, micros int64) *configv1.BudgetSeed {
		return &configv1.BudgetSeed{OrgId: "o", Kind: kind, Id: id, Window: w, WindowStart: start, SpendMicros: micros}
	}
	enc := func(rep *configv1.BudgetSeedReply) []byte {
		b, err := wire.Marshal(rep)
		require.NoError(t, err)
		return b
	}
	got, err := seedReply(enc(&configv1.BudgetSeedReply{Seeds: []*configv1.BudgetSeed{
		seed("key", "k", "1d", 86400, 5), seed("team", "t", "1mo", 0, 7)}}), req)
	require.NoError(t, err)
	require.Equal(t, []int64{5, 7}, got)

	for name, c := range map[string]struct {
		data []byte
		want string
	}{
		"error":      {enc(&configv1.BudgetSeedReply{Error: "the ledger (Postgres) is unavailable"}), "control plane: the ledger (Postgres) is unavailable"},
		"too few":    {enc(&configv1.BudgetSeedReply{Seeds: []*configv1.BudgetSeed{seed("key", "k", "1d", 86400, 5)}}), "1 seeds for 2 scopes"},
		"reordered":  {enc(&configv1.BudgetSeedReply{Seeds: []*configv1.BudgetSeed{seed("team", "t", "1mo", 0, 7), seed("key", "k", "1d", 86400, 5)}}), "does not answer"},
		"old window": {enc(&configv1.BudgetSeedReply{Seeds: []*configv1.BudgetSeed{seed("key", "k", "1d", 0, 5), seed("team", "t", "1mo", 0, 7)}}), "does not answer"},
		"negative":   {enc(&configv1.BudgetSeedReply{Seeds: []*configv1.BudgetSeed{seed("key", "k", "1d", 86400, -1), seed("team", "t", "1mo", 0, 7)}}), "does not answer"},
		"garbage":    {[]byte{0xff, 0xff}, "decode seed reply"},
	} {
		_, err := seedReply(c.data, req)
		require.ErrorContains(t, err, c.want, name)
	}
}
