package gateway

import (
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestLimitScopesIncludeProjectAndTagScopes: the project and tag scopes
// of a key join the request's scopes after the principal's levels and the
// end customer, each with its own limits and budget, in the same list the
// one admission call checks; a scope without any limit is left out.
func TestLimitScopesIncludeProjectAndTagScopes(t *testing.T) {
	t.Parallel()
	p := &catalog.Principal{
		Key: &configv1.Key{Id: "key_1", OrgId: "org_a", Project: "search", Tags: []string{"nightly", "empty"},
			Limits: &configv1.Limits{RpmLimit: proto.Int64(100)}},
		Org: &configv1.Org{Id: "org_a"},
	}
	labels := []*configv1.LabelScope{
		{Id: "lsc_p", OrgId: "org_a", Kind: catalog.LabelProject, Name: "search", Limits: &configv1.Limits{
			MaxParallelRequests: proto.Int64(6), MaxBudget: proto.Float64(5), SoftBudget: proto.Float64(1), BudgetDuration: "1d"}},
		{Id: "lsc_t", OrgId: "org_a", Kind: catalog.LabelTag, Name: "nightly", Limits: &configv1.Limits{
			TpmLimit: proto.Int64(1000), RpmLimit: proto.Int64(10), RateLimitFallback: "local"}},
		{Id: "lsc_e", OrgId: "org_a", Kind: catalog.LabelTag, Name: "empty", Limits: &configv1.Limits{}},
	}
	got := limitScopes(p, nil, labels, "m", false)
	require.Equal(t, []limits.Scope{
		{Kind: limits.KindKey, ID: "key_1", RPM: 100},
		{Kind: limits.KindProject, ID: "lsc_p", MaxParallel: 6, Budget: &limits.Budget{CapMicros: 5_000_000, SoftMicros: 1_000_000, Window: "1d"}},
		{Kind: limits.KindTag, ID: "lsc_t", RPM: 10, TPM: 1000, LocalFallback: true},
	}, got)
}
