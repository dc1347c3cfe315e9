package admin

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/labels"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestLabelRulesMatchTheDataPlane: the data plane checks a JWT's mapped
// project and tags with internal/labels (docs/jwt.md); those rules accept
// exactly the names the admin API accepts for project and tag scopes (and
// keys' tags).
func TestLabelRulesMatchTheDataPlane(t *testing.T) {
	t.Parallel()
	names := []string{"search", "a", "Search Team", " lead", "trail ", "tab\there", "ünïcode", "x/y:z_1.2-3", "bad tag",
		strings.Repeat("p", 100), strings.Repeat("p", 101), strings.Repeat("t", 64), strings.Repeat("t", 65), "\xff"}
	for _, n := range names {
		proj := validateLabelScope(&adminv1.LabelScope{Kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT, Name: n})
		require.Equal(t, proj == nil, labels.Project(n) == nil, "project %q: admin %v", n, proj)
		tag := validateLabelScope(&adminv1.LabelScope{Kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG, Name: n})
		require.Equal(t, tag == nil, labels.Tag(n) == nil, "tag %q: admin %v", n, tag)
		c := &validator{}
		validateTags(c, "tags", []string{n, n})
		require.Error(t, c.err(), "duplicate tags are refused")
		require.Error(t, labels.Tags([]string{n, n}))
	}
	many := make([]string, labels.MaxTags+1)
	for i := range many {
		many[i] = "t" + strings.Repeat("x", i%60) + string(rune('a'+i%26))
	}
	c := &validator{}
	validateTags(c, "tags", many)
	require.Error(t, c.err())
	require.Error(t, labels.Tags(many))
}
