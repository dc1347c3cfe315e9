package main

// apply_tenants.go: the apply kinds below teams and users. Like the other
// kinds they refer to each other by name (org, team name, user e-mail),
// never by id:
//
//	kind: Member      org, team, user (e-mail); max_budget_in_team, limits
//	kind: Customer    org, external_id; display_name, limits, metadata
//	kind: Key         org, team (empty: an org key), alias (the key's name
//	                  in the file); user (e-mail), project, tags,
//	                  traffic_class, model_group_aliases, enforced_params,
//	                  allowed_routes, limits, metadata
//	kind: OrgTraffic  org; default_class, rules, demotion (the org's class
//	                  settings and classification rules, as in
//	                  `sluicectl traffic org set`)
//
// A key's token is never in a file: a created key's token is printed once
// by apply (as by `key create`). Keys without an alias are not managed by
// apply (never pruned). OrgTraffic is a settings object: it is set, never
// pruned (an empty document clears it).

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	sigsyaml "sigs.k8s.io/yaml"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// Document kinds of this file.
const (
	kindMember     = "Member"
	kindCustomer   = "Customer"
	kindKey        = "Key"
	kindOrgTraffic = "OrgTraffic"
)

type memberDoc struct {
	Kind            string     `yaml:"kind"`
	Org             string     `yaml:"org"`
	Team            string     `yaml:"team"`
	User            string     `yaml:"user"`
	MaxBudgetInTeam *float64   `yaml:"max_budget_in_team,omitempty"`
	Limits          *limitsDoc `yaml:"limits,omitempty"`
}

type customerDoc struct {
	Kind        string            `yaml:"kind"`
	Org         string            `yaml:"org"`
	ExternalID  string            `yaml:"external_id"`
	DisplayName string            `yaml:"display_name,omitempty"`
	Limits      *limitsDoc        `yaml:"limits,omitempty"`
	Metadata    map[string]string `yaml:"metadata,omitempty"`
}

type keyDoc struct {
	Kind              string            `yaml:"kind"`
	Org               string            `yaml:"org"`
	Team              string            `yaml:"team,omitempty"`
	Alias             string            `yaml:"alias"`
	User              string            `yaml:"user,omitempty"`
	Project           string            `yaml:"project,omitempty"`
	Tags              []string          `yaml:"tags,omitempty"`
	TrafficClass      string            `yaml:"traffic_class,omitempty"`
	ModelGroupAliases map[string]string `yaml:"model_group_aliases,omitempty"`
	EnforcedParams    []string          `yaml:"enforced_params,omitempty"`
	AllowedRoutes     []string          `yaml:"allowed_routes,omitempty"`
	Limits            *limitsDoc        `yaml:"limits,omitempty"`
	Metadata          map[string]string `yaml:"metadata,omitempty"`
}

// orgTrafficDoc is an org's traffic settings (the API message, decoded
// strictly by protojson from the document without kind and org).
type orgTrafficDoc struct {
	Org     string
	Traffic *adminv1.OrgTraffic
}

func (k *keyDoc) id() string { return k.Org + "/" + k.Team + "/" + k.Alias }

// tenantDocs are the documents of this file's kinds.
type tenantDocs struct {
	members   []*memberDoc
	customers []*customerDoc
	keys      []*keyDoc
	traffic   []*orgTrafficDoc
}

// decodeTenantDocument decodes a document of this file's kinds; ok is
// false for another kind.
func (s *docSet) decodeTenantDocument(kind string, node *yaml.Node) (id string, ok bool, err error) {
	need := func(field, v string) error {
		if strings.TrimSpace(v) == "" {
			return fmt.Errorf("%s: %s is required", kind, field)
		}
		return nil
	}
	switch kind {
	case kindMember:
		d := &memberDoc{}
		if err := decodeStrict(node, d, kind); err != nil {
			return "", true, err
		}
		if err := errors.Join(need("org", d.Org), need("team", d.Team), need("user", d.User)); err != nil {
			return "", true, err
		}
		d.User = strings.ToLower(d.User)
		s.members = append(s.members, d)
		id = "Member " + d.Org + "/" + d.Team + "/" + d.User
	case kindCustomer:
		d := &customerDoc{}
		if err := decodeStrict(node, d, kind); err != nil {
			return "", true, err
		}
		if err := errors.Join(need("org", d.Org), need("external_id", d.ExternalID)); err != nil {
			return "", true, err
		}
		s.customers = append(s.customers, d)
		id = "Customer " + d.Org + "/" + d.ExternalID
	case kindKey:
		d := &keyDoc{}
		if err := decodeStrict(node, d, kind); err != nil {
			return "", true, err
		}
		if err := errors.Join(need("org", d.Org), need("alias", d.Alias)); err != nil {
			return "", true, err
		}
		if d.TrafficClass != "" {
			if _, err := parseTrafficClass(d.TrafficClass); err != nil {
				return "", true, fmt.Errorf("key %s: traffic_class: %w", d.id(), err)
			}
		}
		d.User = strings.ToLower(d.User)
		s.keys = append(s.keys, d)
		id = "Key " + d.id()
	case kindOrgTraffic:
		var head struct {
			Org string `yaml:"org"`
		}
		if err := node.Decode(&head); err != nil {
			return "", true, err
		}
		if err := need("org", head.Org); err != nil {
			return "", true, err
		}
		body := node
		if node.Kind == yaml.DocumentNode && len(node.Content) > 0 {
			body = node.Content[0]
		}
		rest := &yaml.Node{Kind: yaml.MappingNode}
		for i := 0; i+1 < len(body.Content); i += 2 {
			if k := body.Content[i].Value; k != "kind" && k != "org" {
				rest.Content = append(rest.Content, body.Content[i], body.Content[i+1])
			}
		}
		y, err := yaml.Marshal(rest)
		if err != nil {
			return "", true, err
		}
		j, err := sigsyaml.YAMLToJSON(y)
		if err != nil {
			return "", true, err
		}
		t := &adminv1.OrgTraffic{}
		if err := protojson.Unmarshal(j, t); err != nil {
			return "", true, fmt.Errorf("OrgTraffic %s: %w", head.Org, err)
		}
		s.traffic = append(s.traffic, &orgTrafficDoc{Org: head.Org, Traffic: t})
		id = "OrgTraffic " + head.Org
	default:
		return "", false, nil
	}
	s.covered[kind] = true
	return id, true, nil
}

// tenantOrgs are the orgs the documents of this file's kinds name.
func (s *docSet) tenantOrgs() []string {
	var out []string
	for _, d := range s.members {
		out = append(out, d.Org)
	}
	for _, d := range s.customers {
		out = append(out, d.Org)
	}
	for _, d := range s.keys {
		out = append(out, d.Org)
	}
	for _, d := range s.traffic {
		out = append(out, d.Org)
	}
	return out
}

// tenantState is what the control plane holds of this file's kinds.
type tenantState struct {
	members   map[string]*adminv1.TeamMember // org/team/email
	customers map[string]*adminv1.Customer   // org/external_id
	keys      map[string]*adminv1.Key        // org/team/alias
	traffic   map[string]*adminv1.OrgTraffic // org
}

// loadTenants reads the live objects of the kinds set covers in the orgs
// it names (teams and users too, which they refer to).
func loadTenants(ctx context.Context, cl *clients, set *docSet, st *liveState) error {
	st.tenantState = tenantState{members: map[string]*adminv1.TeamMember{}, customers: map[string]*adminv1.Customer{},
		keys: map[string]*adminv1.Key{}, traffic: map[string]*adminv1.OrgTraffic{}}
	if !set.covered[kindMember] && !set.covered[kindCustomer] && !set.covered[kindKey] && !set.covered[kindOrgTraffic] {
		return nil
	}
	if len(st.orgs) == 0 {
		orgs, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.Org, string, error) {
			r, err := call(ctx, cl.orgs.ListOrgs, &adminv1.ListOrgsRequest{PageSize: size, PageToken: tok})
			return r.GetOrgs(), r.GetNextPageToken(), err
		})
		if err != nil {
			return fmt.Errorf("list orgs: %w", err)
		}
		for _, o := range orgs {
			st.orgs[o.GetName()] = o
			st.orgName[o.GetId()] = o.GetName()
		}
	}
	for _, org := range set.orgNames() {
		o := st.orgs[org]
		if o == nil {
			continue
		}
		teamName := map[string]string{}
		teams, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.Team, string, error) {
			r, err := call(ctx, cl.teams.ListTeams, &adminv1.ListTeamsRequest{OrgId: o.GetId(), PageSize: size, PageToken: tok})
			return r.GetTeams(), r.GetNextPageToken(), err
		})
		if err != nil {
			return fmt.Errorf("list teams of org %s: %w", org, err)
		}
		for _, t := range teams {
			teamName[t.GetId()] = t.GetName()
			if st.teams[org+"/"+t.GetName()] == nil {
				st.teams[org+"/"+t.GetName()] = t
			}
		}
		email := map[string]string{}
		users, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.User, string, error) {
			r, err := call(ctx, cl.users.ListUsers, &adminv1.ListUsersRequest{OrgId: o.GetId(), PageSize: size, PageToken: tok})
			return r.GetUsers(), r.GetNextPageToken(), err
		})
		if err != nil {
			return fmt.Errorf("list users of org %s: %w", org, err)
		}
		for _, u := range users {
			email[u.GetId()] = u.GetEmail()
			if st.users[org+"/"+u.GetEmail()] == nil {
				st.users[org+"/"+u.GetEmail()] = u
			}
		}
		if set.covered[kindMember] {
			for _, t := range teams {
				ms, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.TeamMember, string, error) {
					r, err := call(ctx, cl.teams.ListTeamMembers, &adminv1.ListTeamMembersRequest{TeamId: t.GetId(), PageSize: size, PageToken: tok})
					return r.GetMembers(), r.GetNextPageToken(), err
				})
				if err != nil {
					return fmt.Errorf("list members of team %s/%s: %w", org, t.GetName(), err)
				}
				for _, m := range ms {
					st.members[org+"/"+t.GetName()+"/"+email[m.GetUserId()]] = m
				}
			}
		}
		if set.covered[kindCustomer] {
			cs, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.Customer, string, error) {
				r, err := call(ctx, cl.customers.ListCustomers, &adminv1.ListCustomersRequest{OrgId: o.GetId(), PageSize: size, PageToken: tok})
				return r.GetCustomers(), r.GetNextPageToken(), err
			})
			if err != nil {
				return fmt.Errorf("list customers of org %s: %w", org, err)
			}
			for _, c := range cs {
				st.customers[org+"/"+c.GetExternalId()] = c
			}
		}
		if set.covered[kindKey] {
			ks, err := collect(ctx, 0, func(ctx context.Context, size int32, tok string) ([]*adminv1.Key, string, error) {
				r, err := call(ctx, cl.keys.ListKeys, &adminv1.ListKeysRequest{OrgId: o.GetId(), PageSize: size, PageToken: tok})
				return r.GetKeys(), r.GetNextPageToken(), err
			})
			if err != nil {
				return fmt.Errorf("list keys of org %s: %w", org, err)
			}
			for _, k := range ks {
				if k.GetAlias() == "" {
					continue // not managed by apply
				}
				id := org + "/" + teamName[k.GetTeamId()] + "/" + k.GetAlias()
				if prev := st.keys[id]; prev != nil {
					return fmt.Errorf("keys %s and %s of org %s both have alias %q in the same team: apply cannot tell them apart (rename one with 'sluicectl key update --alias')",
						prev.GetId(), k.GetId(), org, k.GetAlias())
				}
				st.keys[id] = k
			}
		}
		if set.covered[kindOrgTraffic] {
			r, err := call(ctx, cl.traffic.GetOrgTraffic, &adminv1.GetOrgTrafficRequest{OrgId: o.GetId()})
			if err != nil {
				return fmt.Errorf("get traffic settings of org %s: %w", org, err)
			}
			st.traffic[org] = r.GetTraffic()
		}
	}
	return nil
}

// teamID and userID resolve names at execution time (teams and users
// created earlier in the same run included).
func (st *liveState) teamID(org, name string) (string, error) {
	if t := st.teams[org+"/"+name]; t != nil {
		return t.GetId(), nil
	}
	return "", fmt.Errorf("team %q of org %q does not exist (declare it with kind: Team)", name, org)
}

func (st *liveState) userID(org, email string) (string, error) {
	if u := st.users[org+"/"+email]; u != nil {
		return u.GetId(), nil
	}
	return "", fmt.Errorf("user %q of org %q does not exist (declare it with kind: User)", email, org)
}

// planTenants plans the members, customers, keys and org traffic
// settings of set.
func planTenants(st *liveState, set *docSet) []change {
	var out []change
	for _, d := range set.members {
		key := d.Org + "/" + d.Team + "/" + d.User
		want := &adminv1.TeamMember{MaxBudgetInTeam: d.MaxBudgetInTeam, Limits: d.Limits.proto()}
		cur := st.members[key]
		if cur == nil {
			out = append(out, change{"create", "Member " + key, createLines(want), func(ctx context.Context, st *liveState) error {
				tid, err := st.teamID(d.Org, d.Team)
				if err != nil {
					return err
				}
				uid, err := st.userID(d.Org, d.User)
				if err != nil {
					return err
				}
				_, err = call(ctx, st.cl.teams.AddTeamMember, &adminv1.AddTeamMemberRequest{TeamId: tid, UserId: uid,
					MaxBudgetInTeam: want.MaxBudgetInTeam, Limits: want.Limits})
				return err
			}})
			continue
		}
		if paths, lines := diffFields(cur, want, "max_budget_in_team", "limits"); len(paths) > 0 {
			want.TeamId, want.UserId = cur.GetTeamId(), cur.GetUserId()
			out = append(out, change{"update", "Member " + key, lines, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.teams.UpdateTeamMember, &adminv1.UpdateTeamMemberRequest{Member: want, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}})
				return err
			}})
		}
	}
	for _, d := range set.customers {
		key := d.Org + "/" + d.ExternalID
		want := &adminv1.Customer{ExternalId: d.ExternalID, DisplayName: d.DisplayName, Limits: d.Limits.proto(), Metadata: d.Metadata}
		cur := st.customers[key]
		if cur == nil {
			out = append(out, change{"create", "Customer " + key, createLines(want), func(ctx context.Context, st *liveState) error {
				oid, err := st.orgID(d.Org)
				if err != nil {
					return err
				}
				_, err = call(ctx, st.cl.customers.CreateCustomer, &adminv1.CreateCustomerRequest{OrgId: oid, ExternalId: want.ExternalId,
					DisplayName: want.DisplayName, Limits: want.Limits, Metadata: want.Metadata})
				return err
			}})
			continue
		}
		if paths, lines := diffFields(cur, want, "display_name", "limits", "metadata"); len(paths) > 0 {
			want.Id = cur.GetId()
			out = append(out, change{"update", "Customer " + key, lines, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.customers.UpdateCustomer, &adminv1.UpdateCustomerRequest{Customer: want, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}})
				return err
			}})
		}
	}
	for _, d := range set.keys {
		var tc adminv1.TrafficClass
		if d.TrafficClass != "" {
			tc, _ = parseTrafficClass(d.TrafficClass) // checked when decoded
		}
		want := &adminv1.Key{Alias: d.Alias, Project: d.Project, Tags: d.Tags, TrafficClass: tc, ModelGroupAliases: d.ModelGroupAliases,
			EnforcedParams: d.EnforcedParams, AllowedRoutes: d.AllowedRoutes, Limits: d.Limits.proto(), Metadata: d.Metadata}
		what := "Key " + d.id()
		cur := st.keys[d.id()]
		if cur == nil {
			lines := createLines(want)
			if d.User != "" {
				lines = append(lines, "user: "+d.User)
			}
			out = append(out, change{"create", what, lines, func(ctx context.Context, st *liveState) error {
				req := &adminv1.CreateKeyRequest{Alias: want.Alias, Project: want.Project, Tags: want.Tags, TrafficClass: want.TrafficClass,
					ModelGroupAliases: want.ModelGroupAliases, EnforcedParams: want.EnforcedParams, AllowedRoutes: want.AllowedRoutes,
					Limits: want.Limits, Metadata: want.Metadata}
				var err error
				if req.OrgId, err = st.orgID(d.Org); err != nil {
					return err
				}
				if d.Team != "" {
					if req.TeamId, err = st.teamID(d.Org, d.Team); err != nil {
						return err
					}
				}
				if d.User != "" {
					if req.UserId, err = st.userID(d.Org, d.User); err != nil {
						return err
					}
				}
				r, err := call(ctx, st.cl.keys.CreateKey, req)
				if err != nil {
					return err
				}
				fmt.Fprintf(st.out, "Created key %s (%s): %s\n  This token is shown once and cannot be shown again: store it now.\n",
					d.id(), r.GetKey().GetId(), r.GetToken())
				return nil
			}})
			continue
		}
		paths, lines := diffFields(cur, want, "project", "tags", "traffic_class", "model_group_aliases", "enforced_params", "allowed_routes", "limits", "metadata")
		// The user, by e-mail: compared when it exists, else set by the run
		// that creates it.
		var wantUser string
		if d.User != "" {
			if u := st.users[d.Org+"/"+d.User]; u != nil {
				wantUser = u.GetId()
			}
		}
		if d.User != "" && wantUser == "" || wantUser != cur.GetUserId() {
			paths = append(paths, "user_id")
			lines = append(lines, fmt.Sprintf("user: %s → %s", orUnset(cur.GetUserId()), orUnset(d.User)))
		}
		if len(paths) == 0 {
			continue
		}
		want.Id = cur.GetId()
		out = append(out, change{"update", what, lines, func(ctx context.Context, st *liveState) error {
			if d.User != "" {
				uid, err := st.userID(d.Org, d.User)
				if err != nil {
					return err
				}
				want.UserId = uid
			}
			_, err := call(ctx, st.cl.keys.UpdateKey, &adminv1.UpdateKeyRequest{Key: want, UpdateMask: &fieldmaskpb.FieldMask{Paths: paths}})
			return err
		}})
	}
	for _, d := range set.traffic {
		cur := st.traffic[d.Org]
		if cur == nil {
			cur = &adminv1.OrgTraffic{}
		}
		ja, _ := compareJSON.Marshal(cur)
		jb, _ := compareJSON.Marshal(d.Traffic)
		if string(ja) == string(jb) {
			continue
		}
		lines := rowDiff(cur.ProtoReflect(), d.Traffic.ProtoReflect())
		out = append(out, change{"update", "OrgTraffic " + d.Org, lines, func(ctx context.Context, st *liveState) error {
			oid, err := st.orgID(d.Org)
			if err != nil {
				return err
			}
			_, err = call(ctx, st.cl.traffic.SetOrgTraffic, &adminv1.SetOrgTrafficRequest{OrgId: oid, Traffic: d.Traffic})
			return err
		}})
	}
	return out
}

// planPruneTenants deletes the keys, members and customers of the orgs
// the file names that it no longer declares (only kinds it has documents
// of); they go before users, teams and orgs.
func planPruneTenants(st *liveState, set *docSet) []change {
	var out []change
	if set.covered[kindKey] {
		for _, key := range unnamed(set.keys, func(k *keyDoc) string { return k.id() }, st.keys) {
			out = append(out, deleteByID("Key "+key, st.keys[key].GetId(), func(ctx context.Context, st *liveState, id string) error {
				_, err := call(ctx, st.cl.keys.DeleteKey, &adminv1.DeleteKeyRequest{Id: id})
				return err
			}))
		}
	}
	if set.covered[kindMember] {
		for _, key := range unnamed(set.members, func(m *memberDoc) string { return m.Org + "/" + m.Team + "/" + m.User }, st.members) {
			m := st.members[key]
			out = append(out, change{"delete", "Member " + key, nil, func(ctx context.Context, st *liveState) error {
				_, err := call(ctx, st.cl.teams.RemoveTeamMember, &adminv1.RemoveTeamMemberRequest{TeamId: m.GetTeamId(), UserId: m.GetUserId()})
				return err
			}})
		}
	}
	if set.covered[kindCustomer] {
		for _, key := range unnamed(set.customers, func(c *customerDoc) string { return c.Org + "/" + c.ExternalID }, st.customers) {
			out = append(out, deleteByID("Customer "+key, st.customers[key].GetId(), func(ctx context.Context, st *liveState, id string) error {
				_, err := call(ctx, st.cl.customers.DeleteCustomer, &adminv1.DeleteCustomerRequest{Id: id})
				return err
			}))
		}
	}
	return out
}

// tenantDocuments are the live objects of kind (members, customers, keys,
// org traffic) of the orgs loadTenants read, as apply documents; name
// picks one (a member's user e-mail, a customer's external id, a key's
// alias, an org's name).
func tenantDocuments(st *liveState, kind, name string) ([]any, error) {
	teamName, email := map[string]string{}, map[string]string{}
	for _, t := range st.teams {
		teamName[t.GetId()] = t.GetName()
	}
	for _, u := range st.users {
		email[u.GetId()] = u.GetEmail()
	}
	var docs []any
	switch kind {
	case kindMember:
		for _, key := range sortedKeys(st.members) {
			m := st.members[key]
			org := st.orgName[m.GetOrgId()]
			if name != "" && !strings.EqualFold(email[m.GetUserId()], name) {
				continue
			}
			docs = append(docs, &memberDoc{Kind: kindMember, Org: org, Team: teamName[m.GetTeamId()], User: email[m.GetUserId()],
				MaxBudgetInTeam: m.MaxBudgetInTeam, Limits: limitsFromProto(m.GetLimits())})
		}
	case kindCustomer:
		for _, key := range sortedKeys(st.customers) {
			c := st.customers[key]
			if name != "" && c.GetExternalId() != name {
				continue
			}
			docs = append(docs, &customerDoc{Kind: kindCustomer, Org: st.orgName[c.GetOrgId()], ExternalID: c.GetExternalId(),
				DisplayName: c.GetDisplayName(), Limits: limitsFromProto(c.GetLimits()), Metadata: c.GetMetadata()})
		}
	case kindKey:
		for _, key := range sortedKeys(st.keys) {
			k := st.keys[key]
			if name != "" && k.GetAlias() != name {
				continue
			}
			docs = append(docs, &keyDoc{Kind: kindKey, Org: st.orgName[k.GetOrgId()], Team: teamName[k.GetTeamId()], Alias: k.GetAlias(),
				User: email[k.GetUserId()], Project: k.GetProject(), Tags: k.GetTags(), TrafficClass: trafficClass(k.GetTrafficClass()),
				ModelGroupAliases: k.GetModelGroupAliases(), EnforcedParams: k.GetEnforcedParams(), AllowedRoutes: k.GetAllowedRoutes(),
				Limits: limitsFromProto(k.GetLimits()), Metadata: k.GetMetadata()})
		}
	case kindOrgTraffic:
		for _, org := range sortedKeys(st.traffic) {
			if name != "" && org != name {
				continue
			}
			j, err := compareJSON.Marshal(st.traffic[org])
			if err != nil {
				return nil, err
			}
			y, err := sigsyaml.JSONToYAML(j)
			if err != nil {
				return nil, err
			}
			var body yaml.Node
			if err := yaml.Unmarshal(y, &body); err != nil {
				return nil, err
			}
			doc := &yaml.Node{Kind: yaml.MappingNode}
			str := func(v string) *yaml.Node { return &yaml.Node{Kind: yaml.ScalarNode, Value: v} }
			doc.Content = append(doc.Content, str("kind"), str(kindOrgTraffic), str("org"), str(org))
			if len(body.Content) > 0 && body.Content[0].Kind == yaml.MappingNode {
				doc.Content = append(doc.Content, body.Content[0].Content...)
			}
			docs = append(docs, doc)
		}
	}
	return docs, nil
}
