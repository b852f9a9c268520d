(define (problem plan_trial_T20240101_000000_000002)
(:domain alfred)
(:objects
    agent1 - agent
    Pencil_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    CD_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 - object
    KeyChain_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    CD_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Vase_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    Pillow_bar__plus_05_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 - object
    ButterKnifeType - otype
    CDType - otype
    KeyChainType - otype
    KnifeType - otype
    PencilType - otype
    PillowType - otype
    VaseType - otype
    BedType - rtype
    DeskType - rtype
    DrawerType - rtype
    FridgeType - rtype
    MicrowaveType - rtype
    ShelfType - rtype
    SinkBasinType - rtype
    Desk_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Drawer_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Drawer_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Shelf_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    Bed_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 - receptacle
    loc_bar_0_bar_0_bar_0_bar_0 - location
    loc_bar_1_bar_1_bar_1_bar_45 - location
    loc_bar_2_bar_2_bar_1_bar_45 - location
    loc_bar_3_bar_3_bar_1_bar_45 - location
    loc_bar_4_bar_4_bar_1_bar_45 - location
    loc_bar_5_bar_5_bar_1_bar_45 - location
)
(:init
    (receptacleType Desk_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 DeskType)
    (receptacleAtLocation Desk_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (objectType Pencil_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 PencilType)
    (inReceptacle Pencil_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Desk_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Pencil_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (pickupable Pencil_bar__plus_01_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (objectType CD_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 CDType)
    (inReceptacle CD_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 Desk_bar__plus_01_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation CD_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25 loc_bar_1_bar_1_bar_1_bar_45)
    (pickupable CD_bar__plus_01_dot_00_bar__plus_02_dot_50_bar__minus_01_dot_25)
    (receptacleType Drawer_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 DrawerType)
    (receptacleAtLocation Drawer_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_2_bar_2_bar_1_bar_45)
    (openable Drawer_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectType KeyChain_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 KeyChainType)
    (inReceptacle KeyChain_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Drawer_bar__plus_02_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation KeyChain_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_2_bar_2_bar_1_bar_45)
    (pickupable KeyChain_bar__plus_02_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (receptacleType Drawer_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 DrawerType)
    (receptacleAtLocation Drawer_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_3_bar_3_bar_1_bar_45)
    (openable Drawer_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectType CD_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 CDType)
    (inReceptacle CD_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Drawer_bar__plus_03_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation CD_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_3_bar_3_bar_1_bar_45)
    (pickupable CD_bar__plus_03_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (receptacleType Shelf_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 ShelfType)
    (receptacleAtLocation Shelf_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_4_bar_4_bar_1_bar_45)
    (objectType Vase_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 VaseType)
    (inReceptacle Vase_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Shelf_bar__plus_04_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Vase_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_4_bar_4_bar_1_bar_45)
    (pickupable Vase_bar__plus_04_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (receptacleType Bed_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 BedType)
    (receptacleAtLocation Bed_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25 loc_bar_5_bar_5_bar_1_bar_45)
    (objectType Pillow_bar__plus_05_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 PillowType)
    (inReceptacle Pillow_bar__plus_05_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 Bed_bar__plus_05_dot_00_bar__plus_00_dot_50_bar__minus_01_dot_25)
    (objectAtLocation Pillow_bar__plus_05_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25 loc_bar_5_bar_5_bar_1_bar_45)
    (pickupable Pillow_bar__plus_05_dot_00_bar__plus_01_dot_50_bar__minus_01_dot_25)
    (canContain BedType CDType)
    (canContain BedType KeyChainType)
    (canContain BedType PencilType)
    (canContain BedType PillowType)
    (canContain BedType VaseType)
    (canContain DeskType CDType)
    (canContain DeskType KeyChainType)
    (canContain DeskType PencilType)
    (canContain DeskType PillowType)
    (canContain DeskType VaseType)
    (canContain DrawerType CDType)
    (canContain DrawerType KeyChainType)
    (canContain DrawerType PencilType)
    (canContain DrawerType PillowType)
    (canContain DrawerType VaseType)
    (canContain FridgeType CDType)
    (canContain FridgeType KeyChainType)
    (canContain FridgeType PencilType)
    (canContain FridgeType PillowType)
    (canContain FridgeType VaseType)
    (canContain MicrowaveType CDType)
    (canContain MicrowaveType KeyChainType)
    (canContain MicrowaveType PencilType)
    (canContain MicrowaveType PillowType)
    (canContain MicrowaveType VaseType)
    (canContain ShelfType CDType)
    (canContain ShelfType KeyChainType)
    (canContain ShelfType PencilType)
    (canContain ShelfType PillowType)
    (canContain ShelfType VaseType)
    (canContain SinkBasinType CDType)
    (canContain SinkBasinType KeyChainType)
    (canContain SinkBasinType PencilType)
    (canContain SinkBasinType PillowType)
    (canContain SinkBasinType VaseType)
    (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_0)
)
(:goal (exists (?r - receptacle) (exists (?o1 - object) (and (objectType ?o1 CDType) (receptacleType ?r BedType) (inReceptacle ?o1 ?r) (exists (?o2 - object) (and (not (= ?o1 ?o2)) (objectType ?o2 CDType) (inReceptacle ?o2 ?r)))))))
)
