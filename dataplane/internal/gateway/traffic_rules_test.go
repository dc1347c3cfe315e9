package gateway

import (
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane/internal/classify"
	"github.com/sluicegw/sluice/dataplane/internal/openai"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

// TestRuleGrantsNoModel: issue 12, "a rule cannot … grant a model". A
// User-Agent rule classifies a key's request, but the key's allowed models
// still decide: a group the key may not use is refused 403
// model_not_allowed with the rule's header as with none, while the
// allowed group is served in the rule's class.
func TestRuleGrantsNoModel(t *testing.T) {
	e := newEnv(t)
	sim := startSim(t, nil)
	e.group("m")
	e.group("secret")
	e.deploy("dm", "m", sim.URL()+"/v1", nil)
	e.deploy("ds", "secret", sim.URL()+"/v1", nil)
	e.snap.Orgs[0].Traffic = &configv1.OrgTraffic{
		Rules: []*configv1.ClassificationRule{{Header: "User-Agent", Pattern: "^claude-code/", TrafficClass: classAgent}},
	}
	tok := e.key("scoped", func(k *configv1.Key) { k.Limits = &configv1.Limits{AllowedModels: []string{"m"}} })
	e.apply()

	c, r := classOf(t, e, tok, chatBody("m", ""), "User-Agent", "claude-code/1.0")
	require.Equal(t, []string{"agent", "rule:0"}, []string{c, r})
	for _, hdr := range [][]string{{"User-Agent", "claude-code/1.0"}, {"User-Agent", "curl/8"}} {
		er := readErr(t, e.post(RouteChat, tok, chatBody("secret", ""), hdr...))
		require.Equal(t, http.StatusForbidden, er.Status, "%v", hdr)
		require.Equal(t, openai.CodeModelNotAllowed, er.Error.Code, "%v", hdr)
	}
	// The default class again without the rule's header: the rule moved
	// only the class.
	resp := e.post(RouteChat, tok, chatBody("m", ""))
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	require.Equal(t, "interactive", resp.Header.Get(HeaderTrafficClass))
	require.Equal(t, classify.ReasonDefault, resp.Header.Get(HeaderClassReason))
}
