package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func getCommand() *command {
	return leaf("get", "KIND [NAME]", "write objects as apply documents (kinds: org, team, user, member, customer, key, org-traffic, model-group); the output is input 'apply -f' accepts", runGet)
}

// getKind maps the names 'get' accepts to document kinds.
var getKind = map[string]string{
	"org": kindOrg, "orgs": kindOrg, "Org": kindOrg,
	"team": kindTeam, "teams": kindTeam, "Team": kindTeam,
	"user": kindUser, "users": kindUser, "User": kindUser,
	"member": kindMember, "members": kindMember, "Member": kindMember,
	"customer": kindCustomer, "customers": kindCustomer, "Customer": kindCustomer,
	"key": kindKey, "keys": kindKey, "Key": kindKey,
	"org-traffic": kindOrgTraffic, "OrgTraffic": kindOrgTraffic,
	"model-group": kindModelGroup, "model-groups": kindModelGroup, "mg": kindModelGroup, "ModelGroup": kindModelGroup,
}

func runGet(ctx context.Context, a *app, c *cmdArgs) error {
	fs := a.flags(c)
	org := fs.String("org", "", "teams, users, members, customers, keys, org traffic: only those of this org (by name)")
	pos, err := a.parse(fs, c, 1, 2)
	if err != nil {
		return err
	}
	if a.output == outJSON {
		return fmt.Errorf("get writes apply documents: use -o yaml (the default for get)")
	}
	kind, ok := getKind[pos[0]]
	if !ok {
		return fmt.Errorf("get: unknown kind %q (kinds: org, team, user, member, customer, key, org-traffic, model-group)", pos[0])
	}
	name := ""
	if len(pos) == 2 {
		name = pos[1]
	}
	cl, _, err := a.connect()
	if err != nil {
		return err
	}
	docs, err := getDocuments(ctx, cl, kind, name, *org)
	if err != nil {
		return err
	}
	if name != "" && len(docs) == 0 {
		return fmt.Errorf("get: no %s named %q", kind, name)
	}
	return encodeDocuments(a.stdout, docs)
}

// getDocuments reads the objects of kind (name: only that one; org: only
// that org's teams or users) as apply documents.
func getDocuments(ctx context.Context, cl *clients, kind, name, org string) ([]any, error) {
	set := &docSet{covered: map[string]bool{kind: true}}
	st, err := loadState(ctx, cl, set)
	if err != nil {
		return nil, err
	}
	var docs []any
	switch kind {
	case kindOrg:
		for _, n := range sortedKeys(st.orgs) {
			if name != "" && n != name {
				continue
			}
			o := st.orgs[n]
			docs = append(docs, &orgDoc{Kind: kindOrg, Name: o.GetName(), Limits: limitsFromProto(o.GetLimits()), Metadata: o.GetMetadata()})
		}
	case kindTeam, kindUser, kindMember, kindCustomer, kindKey, kindOrgTraffic:
		// loadState reads teams and users of the orgs a file names; here
		// every org (or the one asked for) is named.
		for _, n := range sortedKeys(st.orgs) {
			if org == "" || n == org {
				set.orgs = append(set.orgs, &orgDoc{Name: n})
			}
		}
		if org != "" && len(set.orgs) == 0 {
			return nil, fmt.Errorf("get: no org named %q", org)
		}
		if st, err = loadState(ctx, cl, set); err != nil {
			return nil, err
		}
		if kind != kindTeam && kind != kindUser {
			return tenantDocuments(st, kind, name)
		}
		if kind == kindTeam {
			for _, key := range sortedKeys(st.teams) {
				t := st.teams[key]
				if name != "" && t.GetName() != name {
					continue
				}
				d := &teamDoc{Kind: kindTeam, Org: st.orgName[t.GetOrgId()], Name: t.GetName(), Limits: limitsFromProto(t.GetLimits()),
					Metadata: t.GetMetadata(), ModelGroupAliases: t.GetModelGroupAliases()}
				d.TrafficClass = trafficClass(t.GetTrafficClass())
				docs = append(docs, d)
			}
			break
		}
		for _, key := range sortedKeys(st.users) {
			u := st.users[key]
			if name != "" && !strings.EqualFold(u.GetEmail(), name) {
				continue
			}
			docs = append(docs, &userDoc{Kind: kindUser, Org: st.orgName[u.GetOrgId()], Email: u.GetEmail(),
				DisplayName: u.GetDisplayName(), Limits: limitsFromProto(u.GetLimits()), Metadata: u.GetMetadata()})
		}
	case kindModelGroup:
		for _, n := range sortedKeys(st.groups) {
			if name != "" && n != name {
				continue
			}
			g := st.groups[n]
			d := &modelGroupDoc{Kind: kindModelGroup, Name: g.GetName(), Description: g.GetDescription(), PlatformWide: g.GetPlatformWide(),
				Routing: routingDocOf(g.GetRouting())}
			if ids := g.GetGrantedOrgIds(); len(ids) > 0 {
				names := make([]string, 0, len(ids))
				for _, id := range ids {
					if n := st.orgName[id]; n != "" {
						names = append(names, n)
					} else {
						names = append(names, id)
					}
				}
				slices.Sort(names)
				d.GrantedOrgs = &names
			}
			for _, dep := range st.deps[n] {
				dd := deploymentFromProto(dep)
				// The traffic settings apply accepts under traffic:
				// (reserve, class caps, prefill cap, priority
				// scheduling, queues), so that get | apply is a no-op.
				r, err := call(ctx, cl.traffic.GetDeploymentTraffic, &adminv1.GetDeploymentTrafficRequest{DeploymentId: dep.GetId()})
				if err != nil {
					return nil, fmt.Errorf("get traffic settings of deployment %s: %w", dep.GetId(), err)
				}
				if dd.Traffic, err = trafficDocOf(r.GetTraffic()); err != nil {
					return nil, fmt.Errorf("deployment %s: %w", dep.GetId(), err)
				}
				d.Deployments = append(d.Deployments, dd)
			}
			docs = append(docs, d)
		}
	}
	return docs, nil
}
